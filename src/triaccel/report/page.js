// triaccel report: draws the page from the JSON in #report-data (written by src/triaccel/report/report.cpp).
// Plain DOM + SVG, no libraries, nothing fetched. Every chart is an <svg data-chart=ID data-points=N> where N counts
// the marks drawn from data (points, bars, cells); a chart whose data no run has is a one-line "no ... events" note.
// A chart that throws is replaced by its error, and the error also goes to #page-errors (the page's error log).
(function () {
  'use strict';
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const RUN_COLORS = ['#1f6fb4', '#d6452f', '#2e9e44', '#e8900c', '#7d55b8', '#8c5a3c', '#d9539d', '#17a2b8',
                      '#a5a51e', '#6b7280'];
  const PRECISION_COLORS = {fp32: '#2f62a8', bf16: '#f2a43a', fp16: '#d9462f', fp8: '#7b3294'};
  const FORMAT_COLORS = {'adamw-fp32': '#2f62a8', 'adamw-bf16': '#74a9e0', 'adamw-8bit': '#f2a43a',
                         'factored': '#2e9e44', 'sgd': '#9aa1ab'};
  const OTHER_COLOR = '#b07cc6';
  const W = 600, H = 300, M = {l: 62, r: 14, t: 10, b: 44};

  const report = JSON.parse(document.getElementById('report-data').textContent);
  const runs = report.runs;
  runs.forEach((r, i) => { r.color = RUN_COLORS[i % RUN_COLORS.length]; });

  // ---- small DOM helpers -------------------------------------------------------------------------------------
  function html(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function svg(tag, attrs, parent, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  const finite = (v) => typeof v === 'number' && isFinite(v);
  function fmt(v, digits) {
    if (!finite(v)) return '–';
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
    return v.toFixed(digits === undefined ? (a >= 100 ? 1 : a >= 10 ? 2 : 3) : digits);
  }
  function fmtBytes(b) {
    if (!finite(b)) return '–';
    if (b >= 1e9) return (b / 1e9).toFixed(2) + ' GB';
    if (b >= 1e6) return (b / 1e6).toFixed(2) + ' MB';
    if (b >= 1e3) return (b / 1e3).toFixed(1) + ' kB';
    return b + ' B';
  }

  // ---- axes --------------------------------------------------------------------------------------------------
  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  function linearScale(lo, hi, a, b, zero) {
    if (zero) { lo = Math.min(lo, 0); hi = Math.max(hi, 0); }
    if (!(hi - lo > Math.max(Math.abs(lo), Math.abs(hi)) * 1e-9)) {  // one value (or none): widen around it
      const d = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1; lo -= d; hi += d;
    }
    const step = niceStep(hi - lo, 5);
    lo = Math.floor(lo / step) * step; hi = Math.ceil(hi / step) * step;
    const ticks = [];
    for (let k = 0; k <= 40 && lo + k * step <= hi + step * 1e-9; ++k) {
      const t = lo + k * step;
      ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    }
    const f = (v) => a + (v - lo) / (hi - lo) * (b - a);
    f.ticks = ticks; f.label = (t) => fmt(t, step >= 1 ? 0 : Math.min(6, Math.ceil(-Math.log10(step))));
    return f;
  }
  function logScale(lo, hi, a, b) {
    let l = Math.floor(Math.log10(lo)), h = Math.ceil(Math.log10(hi));
    if (h === l) h = l + 1;
    const f = (v) => a + (Math.log10(v) - l) / (h - l) * (b - a);
    f.ticks = [];
    for (let e = l; e <= h; ++e) f.ticks.push(Math.pow(10, e));
    f.label = (t) => t >= 1e6 ? (t / 1e6) + 'M' : t >= 1e3 ? (t / 1e3) + 'k' : String(t);
    return f;
  }
  function frame(root, x, y, xLabel, yLabel) {
    for (const t of y.ticks) {
      svg('line', {class: 'gridline', x1: M.l, x2: W - M.r, y1: y(t), y2: y(t)}, root);
      svg('text', {x: M.l - 6, y: y(t) + 4, 'text-anchor': 'end'}, root, y.label(t));
    }
    if (x) {
      for (const t of x.ticks) {
        svg('line', {class: 'axis', x1: x(t), x2: x(t), y1: H - M.b, y2: H - M.b + 4}, root);
        svg('text', {x: x(t), y: H - M.b + 16, 'text-anchor': 'middle'}, root, x.label(t));
      }
    }
    svg('line', {class: 'axis', x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b}, root);
    svg('line', {class: 'axis', x1: M.l, x2: M.l, y1: M.t, y2: H - M.b}, root);
    if (xLabel) svg('text', {x: (M.l + W - M.r) / 2, y: H - 6, 'text-anchor': 'middle'}, root, xLabel);
    if (yLabel) {
      svg('text', {x: 14, y: (M.t + H - M.b) / 2, 'text-anchor': 'middle',
                   transform: `rotate(-90 14 ${(M.t + H - M.b) / 2})`}, root, yLabel);
    }
  }
  function newSvg(id, height) {
    return svg('svg', {viewBox: `0 0 ${W} ${height || H}`, 'data-chart': id, role: 'img'});
  }
  function legend(parent, keys) {
    const box = html('div', {class: 'legend'}, parent);
    for (const k of keys) {
      const item = html('span', {class: 'key'}, box);
      const s = svg('svg', {viewBox: '0 0 22 10'}, item);
      if (k.box) svg('rect', {x: 4, y: 0, width: 14, height: 10, fill: k.color}, s);
      else svg('line', {x1: 1, x2: 21, y1: 5, y2: 5, stroke: k.color, 'stroke-width': 2.5,
                        'stroke-dasharray': k.dash || ''}, s);
      item.appendChild(document.createTextNode(k.name));
    }
  }

  // ---- chart kinds -------------------------------------------------------------------------------------------
  // series: [{name, color, dash, points: [[x, y], ...]}]; a null y breaks the line.
  function lineChart(spec) {
    const root = newSvg(spec.id);
    const ok = (p) => finite(p[0]) && finite(p[1]) && (!spec.logX || p[0] > 0);
    const pts = [];
    for (const s of spec.series) for (const p of s.points) if (ok(p)) pts.push(p);
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    const x = spec.logX ? logScale(Math.min(...xs), Math.max(...xs), M.l, W - M.r)
                        : linearScale(Math.min(...xs), Math.max(...xs), M.l, W - M.r, spec.xZero);
    const y = linearScale(Math.min(...ys), Math.max(...ys), H - M.b, M.t, spec.yZero);
    frame(root, x, y, spec.xLabel, spec.yLabel);
    let drawn = 0;
    for (const s of spec.series) {
      let d = '', pen = false;
      for (const p of s.points) {
        if (!ok(p)) { pen = false; continue; }
        d += (pen ? 'L' : 'M') + x(p[0]).toFixed(1) + ' ' + y(p[1]).toFixed(1);
        pen = true; ++drawn;
      }
      if (!d) continue;
      if (s.step) d = d.replace(/L([\d.-]+) ([\d.-]+)/g, (m, px, py) => `H${px}V${py}`);
      svg('path', {d: d, fill: 'none', stroke: s.color, 'stroke-width': s.width || 1.8,
                   'stroke-dasharray': s.dash || '', 'stroke-linejoin': 'round'}, root);
      if (s.markers) {
        for (const p of s.points) {
          if (!ok(p)) continue;
          const c = svg('circle', {cx: x(p[0]), cy: y(p[1]), r: p[3] ? 5 : 3, fill: p[3] ? '#fff' : s.color,
                                   stroke: s.color, 'stroke-width': p[3] ? 2.5 : 1}, root);
          svg('title', {}, c, (p[2] ? p[2] + ': ' : '') + `${fmt(p[1])} at ${fmt(p[0])}`);
        }
      }
    }
    root.setAttribute('data-points', drawn);
    return root;
  }
  // categories: labels along x; series: [{name, color, values: [...], colors?: [...]}], grouped side by side.
  function barChart(spec) {
    const root = newSvg(spec.id);
    const values = [];
    for (const s of spec.series) for (const v of s.values) if (finite(v)) values.push(v);
    const y = linearScale(Math.min(0, ...values), Math.max(...values), H - M.b, M.t, true);
    frame(root, null, y, spec.xLabel, spec.yLabel);
    const n = spec.categories.length, groups = spec.series.length;
    const slot = (W - M.l - M.r) / n, bar = Math.max(1, (slot * 0.8) / groups);
    let drawn = 0;
    spec.categories.forEach((cat, i) => {
      const cx = M.l + slot * (i + 0.5);
      const rotate = n > 8;
      svg('text', {x: cx, y: H - M.b + 14, 'text-anchor': rotate ? 'end' : 'middle',
                   transform: rotate ? `rotate(-30 ${cx} ${H - M.b + 14})` : ''}, root, cat);
      spec.series.forEach((s, k) => {
        const v = s.values[i];
        if (!finite(v)) return;
        const x0 = cx - (slot * 0.8) / 2 + k * bar;
        const top = Math.min(y(v), y(0)), h = Math.max(0.5, Math.abs(y(v) - y(0)));
        const r = svg('rect', {x: x0.toFixed(1), y: top.toFixed(1), width: Math.max(1, bar - 1).toFixed(1),
                               height: h.toFixed(1), fill: (s.colors && s.colors[i]) || s.color}, root);
        svg('title', {}, r, `${s.name ? s.name + ' · ' : ''}${cat}: ${s.label ? s.label(v, i) : fmt(v)}`);
        ++drawn;
      });
    });
    root.setAttribute('data-points', drawn);
    return root;
  }
  // rows: unit names; times: column start times; levels[row][col]: a category (string) or null.
  function heatMap(spec) {
    const rowH = Math.max(10, Math.min(22, 220 / spec.rows.length));
    const height = M.t + rowH * spec.rows.length + M.b;
    const root = newSvg(spec.id, height);
    const times = spec.times;
    const last = times[times.length - 1];
    const end = last + (times.length > 1 ? (last - times[0]) / (times.length - 1) : 1);
    const x = linearScale(times[0], end, M.l + 40, W - M.r, false);
    let drawn = 0;
    spec.rows.forEach((name, r) => {
      const top = M.t + r * rowH;
      svg('text', {x: M.l + 36, y: top + rowH / 2 + 4, 'text-anchor': 'end'}, root, name);
      for (let c = 0; c < times.length; ++c) {
        const level = spec.levels[r][c];
        if (level === null || level === undefined) continue;
        const x0 = Math.max(M.l + 40, x(times[c])), x1 = Math.min(W - M.r, x(c + 1 < times.length ? times[c + 1] : end));
        const cell = svg('rect', {x: x0.toFixed(2), y: top + 1, width: Math.max(0.6, x1 - x0 + 0.4).toFixed(2),
                                  height: rowH - 2, fill: spec.colorOf(level), 'shape-rendering': 'crispEdges'}, root);
        svg('title', {}, cell, `${name}: ${level} from ${fmt(times[c])} s`);
        ++drawn;
      }
    });
    const axisY = M.t + rowH * spec.rows.length;
    for (const t of x.ticks) {
      if (x(t) < M.l + 40 - 0.5 || x(t) > W - M.r + 0.5) continue;
      svg('line', {class: 'axis', x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4}, root);
      svg('text', {x: x(t), y: axisY + 16, 'text-anchor': 'middle'}, root, x.label(t));
    }
    svg('text', {x: (M.l + W - M.r) / 2, y: height - 8, 'text-anchor': 'middle'}, root, spec.xLabel);
    root.setAttribute('data-points', drawn);
    return root;
  }

  // ---- page sections -----------------------------------------------------------------------------------------
  const errors = document.getElementById('page-errors');
  function figure(parent, id, title, note, draw) {
    const fig = html('figure', {class: 'chart', 'data-chart': id}, parent);
    html('figcaption', {}, fig, title);
    if (note) html('p', {class: 'note'}, fig, note);
    try {
      draw(fig);
      const drawn = fig.querySelector('svg[data-points]');
      if (drawn && Number(drawn.getAttribute('data-points')) === 0) {
        fig.className = 'chart nodata';
        fig.replaceChildren();
        html('p', {}, fig, `${title}: these runs' events hold no values to draw`);
      }
    } catch (e) {
      fig.className = 'chart failed';
      html('p', {}, fig, `this chart failed to draw: ${e && e.message ? e.message : e}`);
      console.error(`chart ${id} (${title}): ${e && e.stack ? e.stack : e}`);
    }
    return fig;
  }
  function noData(parent, id, what) {
    const fig = html('figure', {class: 'chart nodata', 'data-chart': id}, parent);
    html('p', {}, fig, `no ${what} in these runs`);
  }
  const withChart = (key) => runs.filter((r) => r.charts && r.charts[key]);
  const zip = (xs, ys) => xs.map((x, i) => [x, ys[i]]);
  function runLegend(fig, list, extra) {
    legend(fig, list.map((r) => ({name: r.name, color: r.color})).concat(extra || []));
  }

  function section(title, blurb) {
    const s = html('section', {}, document.getElementById('charts'));
    html('h2', {}, s, title);
    if (blurb) html('p', {class: 'sub'}, s, blurb);
    return html('div', {class: 'grid'}, s);
  }

  function drawProblems() {
    const bad = runs.filter((r) => r.problems.length);
    const box = document.getElementById('problems');
    if (!bad.length) return;
    box.className = 'problems';
    html('h2', {}, box, `Problems with ${bad.length} of ${runs.length} run${runs.length === 1 ? '' : 's'}`);
    const ul = html('ul', {}, box);
    for (const r of bad) for (const p of r.problems) html('li', {'data-run': r.name}, ul, `${r.name}: ${p}`);
  }

  function drawTable() {
    const parent = document.getElementById('table');
    const cols = [['Run', 'run'], ['Method', 'method'], ['Model', 'model'], ['Dataset', 'dataset'],
                  ['Precision', 'precision'], ['Ranks', 'ranks', 0], ['Epochs', 'epochs', 0], ['Test acc (%)', 'test_acc', 2],
                  ['s / epoch', 'epoch_s', 2], ['Peak GB', 'peak_gb', 3], ['Efficiency score', 'eff_score', 2],
                  ['Figures from', 'source']];
    const best = {};
    for (const key of ['test_acc', 'eff_score']) {
      const v = runs.map((r) => r.row[key]).filter(finite);
      if (v.length > 1) best[key] = Math.max(...v);
    }
    for (const key of ['epoch_s', 'peak_gb']) {
      const v = runs.map((r) => r.row[key]).filter((x) => finite(x) && x > 0);
      if (v.length > 1) best[key] = Math.min(...v);
    }
    const t = html('table', {class: 'runs', id: 'runs-table'}, parent);
    const head = html('tr', {}, html('thead', {}, t));
    for (const c of cols) html('th', {class: c.length > 2 ? 'num' : ''}, head, c[0]);
    const body = html('tbody', {}, t);
    for (const r of runs) {
      const tr = html('tr', {'data-run': r.name}, body);
      for (const c of cols) {
        const v = r.row[c[1]];
        if (c[1] === 'run') {
          const td = html('td', {title: r.file}, tr);
          html('span', {class: 'swatch', style: `background:${r.color}`}, td);
          td.appendChild(document.createTextNode(r.name + (r.problems.length ? ' ⚠' : '')));
        } else if (c.length > 2) {
          html('td', {class: 'num' + (finite(v) && best[c[1]] === v ? ' best' : '')}, tr, finite(v) ? fmt(v, c[2]) : '–');
        } else {
          html('td', {class: c[1] === 'source' && v !== 'summary' ? 'muted' : ''}, tr, v || '–');
        }
      }
    }
    html('p', {class: 'sub'}, parent,
         'Efficiency score = test accuracy (%) / (seconds per epoch × peak GB), as in the Tri-Accel paper; bold: best ' +
         'of the runs given. Seconds per epoch: mean of the last 5 epochs. The same table is in ' + report.csv + '.');
  }

  function drawCurves() {
    const grid = section('Accuracy and loss', 'Solid: test set; dashed: training set (mean over the epoch).');
    const list = withChart('epochs');
    if (!list.length) {
      for (const id of ['loss-epoch', 'acc-epoch', 'loss-time', 'acc-time']) noData(grid, id, 'epoch events');
      return;
    }
    const specs = [['loss-epoch', 'Loss per epoch', 'epoch', 'loss', 'test_loss', 'train_loss'],
                   ['acc-epoch', 'Accuracy per epoch', 'epoch', 'accuracy (%)', 'test_acc', 'train_acc'],
                   ['loss-time', 'Loss over time', 'time_s', 'loss', 'test_loss', 'train_loss'],
                   ['acc-time', 'Accuracy over time', 'time_s', 'accuracy (%)', 'test_acc', 'train_acc']];
    for (const [id, title, xKey, yLabel, testKey, trainKey] of specs) {
      figure(grid, id, title, null, (fig) => {
        const series = [];
        for (const r of list) {
          const e = r.charts.epochs;
          series.push({name: r.name + ' test', color: r.color, markers: e.epoch.length <= 40,
                       points: zip(e[xKey], e[testKey])});
          series.push({name: r.name + ' train', color: r.color, dash: '5 4', width: 1.3,
                       points: zip(e[xKey], e[trainKey])});
        }
        fig.appendChild(lineChart({id: id, series: series, xLabel: xKey === 'epoch' ? 'epoch' : 'time (s)',
                                   yLabel: yLabel}));
        runLegend(fig, list, [{name: 'test', color: '#555'}, {name: 'train', color: '#555', dash: '5 4'}]);
      });
    }
  }

  function drawMemory() {
    const grid = section('Batch size and VRAM', 'From batch events (Tri-Accel\'s controller, every control interval) ' +
                         'where a run has them, else epoch events, else NeuroFlux block events.');
    const list = withChart('memory');
    if (!list.length) {
      noData(grid, 'batch-time', 'batch, epoch or block events');
      noData(grid, 'vram-time', 'batch, epoch or block events');
      return;
    }
    figure(grid, 'batch-time', 'Batch size over time', null, (fig) => {
      const series = list.map((r) => ({name: r.name, color: r.color, step: true,
                                       points: zip(r.charts.memory.time_s, r.charts.memory.batch)}));
      fig.appendChild(lineChart({id: 'batch-time', series: series, xLabel: 'time (s)', yLabel: 'batch size',
                                 yZero: true}));
      runLegend(fig, list);
    });
    figure(grid, 'vram-time', 'VRAM over time',
           'current: peak allocated in each interval; peak: the largest so far; budget: --vram-budget (where set); ' +
           'predicted: the peak the run planned for the interval (NeuroFlux\'s blocks)',
           (fig) => {
             const series = [];
             let predicted = false;
             for (const r of list) {
               const m = r.charts.memory;
               series.push({name: r.name, color: r.color, width: 1.2, points: zip(m.time_s, m.current_gb)});
               series.push({name: r.name + ' peak', color: r.color, dash: '6 3', width: 2, points: zip(m.time_s, m.peak_gb)});
               series.push({name: r.name + ' budget', color: r.color, dash: '2 3', width: 1.5,
                            points: zip(m.time_s, m.budget_gb)});
               if (m.predicted_gb) {
                 predicted = true;
                 series.push({name: r.name + ' predicted', color: r.color, dash: '1 2', width: 1.2,
                              points: zip(m.time_s, m.predicted_gb)});
               }
             }
             fig.appendChild(lineChart({id: 'vram-time', series: series, xLabel: 'time (s)', yLabel: 'GB', yZero: true}));
             const keys = [{name: 'current', color: '#555'}, {name: 'peak', color: '#555', dash: '6 3'},
                           {name: 'budget', color: '#555', dash: '2 3'}];
             if (predicted) keys.push({name: 'predicted', color: '#555', dash: '1 2'});
             runLegend(fig, list, keys);
           });
  }

  function drawPrecision() {
    const grid = section('Per-unit precision', 'Each row a unit, each column a precision decision (Tri-Accel).');
    const list = withChart('precision');
    if (!list.length) { noData(grid, 'precision', 'precision events'); return; }
    for (const r of list) {
      const p = r.charts.precision;
      figure(grid, 'precision', `Precision per unit over time — ${r.name}`, `${p.time_s.length} decisions`, (fig) => {
        const colorOf = (l) => PRECISION_COLORS[l] || OTHER_COLOR;
        fig.appendChild(heatMap({id: 'precision', rows: p.units, times: p.time_s, levels: p.levels, colorOf: colorOf,
                                 xLabel: 'time (s)'}));
        const seen = [...new Set(p.levels.flat().filter((l) => l))];
        legend(fig, seen.map((l) => ({name: l, color: colorOf(l), box: true})));
      }).setAttribute('data-run', r.name);
    }
  }

  function drawCurvature() {
    const grid = section('Curvature', 'The largest Hessian eigenvalue per unit (the last probe of each), by power ' +
                         'iteration on Hessian-vector products; a unit never probed has no bar.');
    const list = withChart('curvature');
    if (!list.length) { noData(grid, 'lambda-max', 'curvature events'); return; }
    figure(grid, 'lambda-max', 'λ_max per unit', null, (fig) => {
      const units = [];
      for (const r of list) for (const u of r.charts.curvature.units) if (!units.includes(u)) units.push(u);
      const series = list.map((r) => {
        const c = r.charts.curvature;
        return {name: r.name, color: r.color,
                values: units.map((u) => { const i = c.units.indexOf(u); return i < 0 ? null : c.lambda_max[i]; }),
                label: (v, i) => `λ_max ${fmt(v)} (${c.probes[c.units.indexOf(units[i])]} probes)`};
      });
      fig.appendChild(barChart({id: 'lambda-max', categories: units, series: series, yLabel: 'λ_max'}));
      runLegend(fig, list);
    });
  }

  function drawPlan() {
    const grid = section('Optimizer-state plan (BAOC)', 'The last plan of each run: the state format per unit, its ' +
                         'memory and its risk.');
    const list = withChart('plan');
    if (!list.length) {
      noData(grid, 'plan-memory', 'BAOC plan events');
      noData(grid, 'plan-risk', 'BAOC plan events');
      return;
    }
    for (const r of list) {
      const p = r.charts.plan;
      const units = p.units.map((u) => u.unit);
      const colors = p.units.map((u) => FORMAT_COLORS[u.format] || OTHER_COLOR);
      const formats = [...new Set(p.units.map((u) => u.format))];
      const keys = formats.map((f) => ({name: f, color: FORMAT_COLORS[f] || OTHER_COLOR, box: true}));
      const note = `step ${p.step}: ${fmtBytes(p.total_bytes)} of state (budget ${fmtBytes(p.budget_bytes)}, ` +
                   `fp32 AdamW ${fmtBytes(p.adamw_fp32_bytes)}), total risk ${fmt(p.total_risk)}`;
      figure(grid, 'plan-memory', `Optimizer state per unit — ${r.name}`, note, (fig) => {
        fig.appendChild(barChart({id: 'plan-memory', categories: units, yLabel: 'state (MB)',
                                  series: [{name: '', color: '#888', colors: colors,
                                            values: p.units.map((u) => finite(u.bytes) ? u.bytes / 1e6 : null),
                                            label: (v, i) => `${p.units[i].format}, ${fmtBytes(p.units[i].bytes)}`}]}));
        legend(fig, keys);
      }).setAttribute('data-run', r.name);
      figure(grid, 'plan-risk', `Risk per unit — ${r.name}`, 'the format plan\'s estimate of the loss of update quality',
             (fig) => {
               fig.appendChild(barChart({id: 'plan-risk', categories: units, yLabel: 'risk',
                                         series: [{name: '', color: '#888', colors: colors,
                                                   values: p.units.map((u) => u.risk),
                                                   label: (v, i) => `${p.units[i].format}, risk ${fmt(v)}`}]}));
               legend(fig, keys);
             }).setAttribute('data-run', r.name);
    }
  }

  function drawMemoryPlan() {
    const grid = section('Memory plan', 'The memory planner\'s last plan of each run: what each unit\'s activations ' +
                         'hold at the micro-batch (a recomputed unit keeps only its input), beside the other consumers.');
    const list = withChart('memory_plan');
    if (!list.length) { noData(grid, 'memory-plan', 'memory_plan events with per-unit figures'); return; }
    const KEPT = '#2f62a8', RECOMPUTED = '#f2a43a';
    for (const r of list) {
      const p = r.charts.memory_plan;
      const units = p.units.map((u) => u.unit);
      const others = Object.entries(p.consumers).map(([k, v]) => `${k} ${fmtBytes(v)}`).join(', ');
      const measured = finite(p.measured_peak_bytes) ? `, measured ${fmtBytes(p.measured_peak_bytes)}` : '';
      const budget = finite(p.budget_bytes) ? ` of a ${fmtBytes(p.budget_bytes)} budget` : '';
      const note = `step ${p.step} (${p.reason}): micro-batch ${p.micro_batch} × ${p.accumulation}, data on the ` +
                   `${p.data_placement === 'host' ? 'host (streamed)' : 'GPU'}; peak predicted ` +
                   `${fmtBytes(p.predicted_peak_bytes)}${measured}${budget}. Other consumers: ${others}.`;
      figure(grid, 'memory-plan', `Activations per unit — ${r.name}`, note, (fig) => {
        fig.appendChild(barChart({id: 'memory-plan', categories: units, yLabel: 'activations (MB)',
                                  series: [{name: '', color: KEPT,
                                            colors: p.units.map((u) => (u.recompute ? RECOMPUTED : KEPT)),
                                            values: p.units.map((u) => (finite(u.activation_bytes)
                                                                        ? u.activation_bytes / 1e6 : null)),
                                            label: (v, i) => `${p.units[i].recompute ? 'recomputed' : 'kept'}, ` +
                                                             fmtBytes(p.units[i].activation_bytes)}]}));
        legend(fig, [{name: 'kept', color: KEPT, box: true}, {name: 'recomputed', color: RECOMPUTED, box: true}]);
      }).setAttribute('data-run', r.name);
    }
  }

  function drawNeuroFlux() {
    const grid = section('NeuroFlux', 'Local learning: each unit\'s auxiliary-head accuracy, and the exit curve ' +
                         '(accuracy of the network cut after each unit).');
    const blocks = withChart('blocks'), exits = withChart('exits');
    if (!blocks.length) noData(grid, 'nf-blocks', 'NeuroFlux block events');
    for (const r of blocks) {
      const b = r.charts.blocks;
      figure(grid, 'nf-blocks', `Accuracy per block — ${r.name}`, `${new Set(b.block).size} blocks`, (fig) => {
        const cats = b.unit.map((u, i) => `${u} (b${b.block[i]})`);
        fig.appendChild(barChart({id: 'nf-blocks', categories: cats, yLabel: 'accuracy (%)', series: [
          {name: 'train', color: '#9ab8de', values: b.train_acc},
          {name: 'held out', color: '#f2a43a', values: b.holdout_acc},
          {name: 'test', color: '#2f62a8', values: b.test_acc}]}));
        legend(fig, [{name: 'train', color: '#9ab8de', box: true}, {name: 'held out', color: '#f2a43a', box: true},
                     {name: 'test', color: '#2f62a8', box: true}]);
      }).setAttribute('data-run', r.name);
    }
    if (!exits.length) { noData(grid, 'nf-exit', 'NeuroFlux exit events'); return; }
    figure(grid, 'nf-exit', 'Exit curve: accuracy against parameters kept',
           'open circle: the exported exit (fewest parameters within --nf-exit-tolerance)', (fig) => {
             const series = [];
             for (const r of exits) {
               const e = r.charts.exits;
               series.push({name: r.name, color: r.color, markers: true,
                            points: e.params.map((p, i) => [p, e.test_acc[i], e.unit[i], i === e.chosen])});
               series.push({name: r.name + ' held out', color: r.color, dash: '4 3', width: 1.2,
                            points: zip(e.params, e.holdout_acc)});
             }
             fig.appendChild(lineChart({id: 'nf-exit', series: series, logX: true, xLabel: 'parameters (log scale)',
                                        yLabel: 'accuracy (%)'}));
             runLegend(fig, exits, [{name: 'test', color: '#555'}, {name: 'held out', color: '#555', dash: '4 3'}]);
           });
  }

  for (const part of [drawProblems, drawTable, drawCurves, drawMemory, drawPrecision, drawCurvature, drawPlan,
                      drawMemoryPlan, drawNeuroFlux]) {
    try {
      part();
    } catch (e) {
      console.error(`${part.name}: ${e && e.stack ? e.stack : e}`);
    }
  }
  document.body.setAttribute('data-rendered', errors.textContent ? 'with-errors' : 'ok');
})();
