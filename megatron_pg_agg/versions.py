"""The one place the supported megatron-core releases are written (setup.py reads it as text).

Every runtime patch checks the installed release against it before touching anything, the
trainer refuses to start outside it, and pip installs inside it. Widen it only after the patches'
targets and the loss contract (3-tuple, calculate_per_token_loss, finalize_model_grads' count)
have been re-verified against the new release."""

SUPPORTED_MEGATRON_CORE = ">=0.16.0,<0.17"
