"""What the slime and miles plug-ins share (slime's loss and hooks, which miles keeps; docs/slime.md, docs/miles.md).

``weights`` holds the per-sample denominators ``D_i = W / (R c_i)`` both hosts' ``get_sum_of_sample_mean``
divides by (no host import); ``hook`` the conversion hook's common part: the config block's keys, the
flags both hosts refuse, the denominator masks read before the host's conversion zeroes removed
samples, and the checkout check. Each host's folder (``slime/``, ``miles/``) holds what differs: its
default conversion, its step grouping and step divisor, its own refusals.
"""
