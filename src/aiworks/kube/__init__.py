"""Kubernetes helpers the Helm chart runs: the install hook's Secrets, probes over mutual TLS, and `helm test`'s check."""
