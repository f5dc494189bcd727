"""Parent of the private modules that ``feature_loading`` loads from feature directories that are not
importable packages: under this name, a feature file never takes another module's place in ``sys.modules``."""
