"""The reference design's ``_storage`` package name: see ``_storage._core`` (kvxfer's slot allocator and
tier storage under the reference's class names)."""
