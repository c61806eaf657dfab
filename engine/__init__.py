"""kvgate engine package."""
