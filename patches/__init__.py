"""patches."""
X = 1
