"""Sources of batches: the contract the serving loop relies on, the unit sources (block reader,
ordering, fingerprint, columns, storage) and the Parquet, Fuel and sample sources built on them."""
