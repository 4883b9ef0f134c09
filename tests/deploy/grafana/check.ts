/**
 * What a dashboard of this project must be, for `tsc` to check.
 *
 * embed.mjs writes each grafana/dashboards/*.json into generated/ as
 * `const dashboard: DashboardJson = {...}` and
 * `const panels: PanelPluginJson[] = [...]`; `npm run check` then runs
 * `tsc`, which fails on any key or value the types below do not allow.
 *
 * - The dashboard as a whole is checked against `Dashboard` from
 *   @grafana/schema, with Prometheus annotation queries.
 * - Each panel's `options` and `fieldConfig.defaults.custom` are checked
 *   against the schema of its panel plugin (`stat`, `timeseries`); a panel
 *   of any other type is an error until it is added to `PanelPlugins`.
 * - Each query target is checked against `PrometheusQuery`.
 */
import type { AnnotationQuery, DataQuery, Dashboard } from "@grafana/schema";
import type * as stat from "@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen";
import type * as timeseries from "@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";

/**
 * The type of `T` as it is written in JSON: JSON has no enums, so a string
 * enum (e.g. `FieldColorModeId.PaletteClassic`) becomes the union of its
 * values (`"palette-classic" | ...`). Applied through objects and arrays.
 */
export type Json<T> = T extends string
  ? `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends ReadonlyArray<infer Item>
      ? Array<Json<Item>>
      : T extends object
        ? { [Key in keyof T]: Json<T[Key]> }
        : T;

/**
 * A query of Grafana's Prometheus datasource, as Grafana saves it. @grafana/schema
 * has no type for it (it lives in @grafana/prometheus, which pulls in React),
 * so the fields this project uses are declared here.
 */
export interface PrometheusQuery extends DataQuery {
  expr: string;
  legendFormat?: string;
  instant?: boolean;
  range?: boolean;
  editorMode?: "code" | "builder";
  format?: "time_series" | "table" | "heatmap";
  interval?: string;
  exemplar?: boolean;
}

/** A dashboard of this project: @grafana/schema's, with Prometheus annotations. */
export type DashboardJson = Omit<Json<Dashboard>, "annotations"> & {
  annotations?: { list?: Array<Json<AnnotationQuery<PrometheusQuery>>> };
};

/** The panel plugins the dashboards may use, with their option schemas. */
interface PanelPlugins {
  stat: { options: stat.Options; custom: never };
  timeseries: { options: timeseries.Options; custom: timeseries.FieldConfig };
}

/** One panel's plugin-specific parts, as embed.mjs extracts them. */
export type PanelPluginJson = {
  [Type in keyof PanelPlugins]: {
    type: Type;
    title: string;
    options: Json<PanelPlugins[Type]["options"]>;
    custom?: Json<PanelPlugins[Type]["custom"]>;
    targets: Array<Json<PrometheusQuery>>;
  };
}[keyof PanelPlugins];
