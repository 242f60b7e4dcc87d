"""Autoscaling replicas on the Redis queue's backlog and deadlines."""
