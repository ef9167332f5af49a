"""``python -m geoshard.cli``: the ``geoshard`` command, for children started with this interpreter."""

from geoshard.cli.app import main

main(prog_name="geoshard")
