"""Test support shipped with the package: fault points for crash-safety tests (`faults`)."""
