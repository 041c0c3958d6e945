"""`aiworks up`: supervises the suite as local processes."""
