"""`cluster simulate`: the deployed routing and autoscaling code against the performance model
at cluster scale (trace generator, simulated cluster, strategies compared)."""
