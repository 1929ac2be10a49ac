"""timeslice client library (placeholder exports are completed below)."""
