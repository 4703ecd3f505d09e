"""Context parallelism for varlen attention (installed as `varlen.comm`)."""
