"""What both runtime adapters share: the sans-IO driver and the runtime support around it."""
