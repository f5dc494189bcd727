"""Write throw-away namespaces (an API module plus feature modules) into a directory for tests.

Every call picks fresh module and namespace names, because loaded modules stay in ``sys.modules``.
"""

from __future__ import annotations

import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

API_TEMPLATE = """
from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry


class Mapper(BaseConfigAPIMapper):
    def parse_config_and_api(self, config, **kwargs):
        return True, dict(config)


@Registry.register_namespace_api(namespace="{ns}")
class {api_class}({api_base}):
    def input_assertions_hook(self, api_name, **kwargs):
        pass

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return feature_obj.parse_config_and_api(config, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False
"""

FEATURE_TEMPLATE = """

@Registry.register_feature(namespace="{ns}")
class {feature}(Mapper):
    @api_method
    def probe(self, config, layer_name, **kwargs):
        return ("{feature}", layer_name, config.get("value"))
"""


@dataclass
class Namespace:
    name: str
    directory: Path
    api_module: str
    feature_module: str
    features: tuple[str, ...]

    @property
    def api_file(self) -> Path:
        return self.directory / f"{self.api_module}.py"

    @property
    def feature_file(self) -> Path:
        return self.directory / f"{self.feature_module}.py"


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def write_namespace(
    directory: Path,
    features: tuple[str, ...] = ("FeatA", "FeatB"),
    *,
    api_base: str = "BaseNamespaceAPI",
    with_api: bool = True,
    marker: Path | None = None,
    relative_import: bool = False,
) -> Namespace:
    """Write ``a_feat_<id>.py`` (features, importing ``Mapper`` from its sibling) and ``z_api_<id>.py``.

    The feature file sorts first, so loading it imports the API module as a sibling. ``marker`` gets one
    line appended each time the feature module is executed. ``relative_import`` imports the sibling with
    ``from .z_api_<id> import Mapper`` (for directories loaded as packages).
    """
    directory.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:10]
    ns = Namespace(f"ns_{tag}", directory, f"z_api_{tag}", f"a_feat_{tag}", tuple(features))
    mapper_source = API_TEMPLATE.format(ns=ns.name, api_class=f"Api_{tag}", api_base=api_base)
    if with_api:
        ns.api_file.write_text(textwrap.dedent(mapper_source))
        source_of_mapper = f"from {'.' if relative_import else ''}{ns.api_module} import Mapper\n"
    else:
        source_of_mapper = "from nvdlfw_inspect.base import BaseConfigAPIMapper\n\n\n" + (
            "class Mapper(BaseConfigAPIMapper):\n"
            "    def parse_config_and_api(self, config, **kwargs):\n"
            "        return True, dict(config)\n"
        )
    lines = [source_of_mapper, "from nvdlfw_inspect.registry import Registry, api_method\n"]
    if marker is not None:
        lines.append(f"with open({str(marker)!r}, 'a') as _marker:\n    _marker.write('executed\\n')\n")
    lines.extend(FEATURE_TEMPLATE.format(ns=ns.name, feature=name) for name in features)
    ns.feature_file.write_text("".join(lines))
    return ns
