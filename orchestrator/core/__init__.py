"""The controller: the machine built from the transition table, the actions per event, the region ledger, config."""
