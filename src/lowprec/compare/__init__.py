"""``nvdlfw-inspect compare``: the demo GPT trained in several formats from one seed, on one page."""

from lowprec.compare.recipes import DEFAULT_RECIPES, RECIPES, parse_recipes
from lowprec.compare.runs import compare_formats, statistics_config

__all__ = ["DEFAULT_RECIPES", "RECIPES", "compare_formats", "parse_recipes", "statistics_config"]
