"""Tests of multi-tenancy and security: tenants, auth, limits, metering, input filters, output masking."""
