"""Tools around a program: simulate, estimate, hardware profiles."""
