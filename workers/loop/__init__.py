"""The replica's loop: claim, run, publish, recover, reserve and pace."""
