"""kvgate schemas package."""
