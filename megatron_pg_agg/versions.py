"""The one place the supported megatron-core releases are written (setup.py reads it as text).

Every runtime patch checks the installed release against it before touching anything, the
trainer refuses to start outside it, and pip installs inside it. Widen it only after the patches'
targets and the loss contract (3-tuple, calculate_per_token_loss, finalize_model_grads' count)
have been re-verified against the new release."""

SUPPORTED_MEGATRON_CORE = ">=0.16.0,<0.17"


def installed_megatron_core_version() -> str:
    """The installed megatron-core version (the distribution metadata, else ``package_info`` of a
    source checkout on PYTHONPATH). Tests monkeypatch it where it is imported (the patch machinery,
    :mod:`megatron_pg_agg.run_config`) to simulate another release."""
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info

        return package_info.__version__


def in_range(installed: str, supported: str = SUPPORTED_MEGATRON_CORE) -> bool:
    """Whether release ``installed`` is inside the specifier set ``supported`` (pre-releases
    included; a version string that does not parse is outside)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(supported).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        return False
