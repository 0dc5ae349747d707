"""Reading compiled programs and checkpoints: planning, inspection, reports and export."""
