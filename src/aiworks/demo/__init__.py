"""The demo model repository, built offline from sklearn's bundled datasets."""
