"""Image folders, the data check and its cache, the three data tiers (DataLoader workers, the decoded cache, the
dataset on the device), the sample dataset."""
