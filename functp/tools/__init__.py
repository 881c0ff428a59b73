"""Tools around a program: simulate, estimate, hardware profiles, print_ranks and
visualize_sharding."""
