// Writes every grafana/dashboards/*.json as a TypeScript module in generated/,
// so that `tsc` checks it against the types declared in check.ts.
//
// Why not `import dashboard from "....json"`: TypeScript widens the strings of
// an imported JSON file to `string`, so a dashboard could never satisfy the
// string unions and enums of @grafana/schema (VariableType, FieldColorModeId,
// ...). An object literal in a .ts file keeps its literal types and also gets
// excess-property checks, which catch misspelt keys.
import { mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { basename, dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const dashboards = process.env.DASHBOARDS_DIR ?? join(here, "..", "..", "..", "grafana", "dashboards");
const out = join(here, "generated");

const files = readdirSync(dashboards).filter((name) => name.endsWith(".json")).sort();
if (files.length === 0) {
  console.error(`no dashboard JSON files in ${dashboards}`);
  process.exit(1);
}

/** Every panel that is not a row, including those nested in collapsed rows. */
function leafPanels(panels) {
  return (panels ?? []).flatMap((panel) =>
    panel.type === "row" ? leafPanels(panel.panels) : [panel],
  );
}

rmSync(out, { recursive: true, force: true });
mkdirSync(out);
for (const name of files) {
  const dashboard = JSON.parse(readFileSync(join(dashboards, name), "utf8"));
  const plugins = leafPanels(dashboard.panels).map((panel) => ({
    type: panel.type,
    title: panel.title,
    options: panel.options,
    custom: panel.fieldConfig?.defaults?.custom,
    targets: panel.targets,
  }));
  const module = [
    `// Written by embed.mjs from grafana/dashboards/${name}; do not edit.`,
    `import type { DashboardJson, PanelPluginJson } from "../check";`,
    ``,
    `export const dashboard: DashboardJson = ${JSON.stringify(dashboard, null, 2)};`,
    ``,
    `export const panels: PanelPluginJson[] = ${JSON.stringify(plugins, null, 2)};`,
    ``,
  ].join("\n");
  writeFileSync(join(out, `${basename(name, ".json")}.ts`), module);
}
console.log(`embedded ${files.length} dashboard(s) from ${relative(here, dashboards)}`);
