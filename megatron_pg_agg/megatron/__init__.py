"""The megatron-core side: the loss function and forward step for its schedules, the settings it
refuses, the model and its THD attention, the MoE router-loss factor, and process-group set-up."""
