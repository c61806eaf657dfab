"""kvgate gateway package."""
