"""The three cache tiers: each client's recent batches (memory), decoded units shared by every
client (decoded), and local copies of a remote dataset's files (disk)."""
