"""``--config cpu-demo``: the shipped configs by name. The resolver is the library's, ``edgekv.config_names`` (the
runtime and the evaluations take a name too, and never import the apps); this name stays for the apps that import
it from here."""

from __future__ import annotations

from edgekv.config_names import (
    SUFFIXES, UnknownConfigName, config_file, config_help, resolve_config, shipped_config_dir, shipped_configs,
    shipped_names)

__all__ = ["SUFFIXES", "UnknownConfigName", "config_file", "config_help", "resolve_config", "shipped_config_dir",
           "shipped_configs", "shipped_names"]
