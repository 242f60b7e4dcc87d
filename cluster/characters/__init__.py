"""Character cards and persona prompts: pure functions shared by the gateway and the backfill."""
