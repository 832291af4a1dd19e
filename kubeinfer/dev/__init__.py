"""Developer tools, not the product: the whole stack on one machine (`kubeinfer local-stack`, `make run`), the
tiny demo model (`kubeinfer demo-model`) and the builders of test models (`kubeinfer random-model`). No module of
the engine, gateway, operator or common imports it; the CLI imports it only inside those dev subcommands."""
