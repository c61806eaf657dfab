"""kvgate protocol package."""
