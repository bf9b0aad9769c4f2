"""`colocate plan`: the command (`command`) and the plan as Rich tables or one JSON object (`show`)."""
