"""``nvdlfw-inspect compare``: the demo GPT (or the user's model) trained in several formats and seeds, or runs that
exist, on one page with a bottom line per format."""

from lowprec.compare.recipes import DEFAULT_RECIPES, RECIPES, parse_recipes
from lowprec.compare.runs import compare_dirs, compare_formats, statistics_config

__all__ = ["DEFAULT_RECIPES", "RECIPES", "compare_dirs", "compare_formats", "parse_recipes", "statistics_config"]
