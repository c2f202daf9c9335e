"""Plug-ins for serving engines. Each lives in its own subpackage and imports its engine only there, so
``kvxfer`` itself never needs an engine installed."""
