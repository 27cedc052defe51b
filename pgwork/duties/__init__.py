"""The daemon's duties, one module each: its pass, its scheduling, its metrics, its part of shutdown."""
