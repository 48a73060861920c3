"""Plans at run time: the container codec (shared with the compiler) and loading."""
