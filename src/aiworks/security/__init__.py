"""Security primitives: certificates, the audit chain, encrypted and signed models (docs/security.md)."""
