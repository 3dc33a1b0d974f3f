"""What a finished or running run is reported as: comparisons, goodput accounting, figures."""
