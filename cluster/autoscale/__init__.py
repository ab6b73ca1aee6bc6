"""Autoscaling policies and the speculation-aware signals they share with routing."""
