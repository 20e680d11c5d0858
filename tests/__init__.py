"""pushkv's tests, a folder per subsystem; ``support/`` holds what several of them use."""
