"""Ingest (writers only): synthetic raw recordings (``synth``), the raw TSV format, and its
conversion to a Parquet dataset with a manifest (``convert``)."""
