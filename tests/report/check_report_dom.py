#!/usr/bin/env python3
"""Checks a report page as Chromium rendered it (--dump-dom after the scripts ran) and Chromium's log.

usage: check_report_dom.py DOM_HTML CHROMIUM_LOG [--expect-chart ID]... [--expect-nodata ID]... [--expect-text TEXT]...
                           [--runs N]
Fails (exit 1, one line per failure) unless: the page's script finished (body data-rendered="ok"); the page's own
error log (#page-errors, fed by window 'error' events and console.error) is empty; the log has no CONSOLE line (the
page writes nothing to the console when all is well); no chart failed; every drawn chart (<svg data-chart>) has
data-points > 0 and holds at least one path, rect or circle; each --expect-chart ID was drawn at least once; each
--expect-nodata ID shows its "no ... events" note; each --expect-text occurs in the rendered text; the table has N rows.
"""
import argparse
import re
import sys
from html.parser import HTMLParser


class Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack = []          # open elements: (tag, attrs)
        self.body = {}
        self.svgs = []           # {id, points, marks}
        self.figures = []        # {id, class}
        self.page_errors = ''
        self.text = []
        self.rows = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == 'body':
            self.body = a
        if tag == 'svg' and 'data-chart' in a:
            self.svgs.append({'id': a['data-chart'], 'points': a.get('data-points'), 'marks': 0})
        if tag in ('path', 'rect', 'circle') and any(t == 'svg' and 'data-chart' in at for t, at in self.stack):
            self.svgs[-1]['marks'] += 1
        if tag == 'figure':
            self.figures.append({'id': a.get('data-chart'), 'class': a.get('class', '')})
        if tag == 'tr' and 'data-run' in a and any(at.get('id') == 'runs-table' for _, at in self.stack):
            self.rows += 1
        if tag not in ('path', 'rect', 'circle', 'line', 'meta', 'br', 'img', 'input'):
            self.stack.append((tag, a))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if any(at.get('id') == 'page-errors' for _, at in self.stack):
            self.page_errors += data
        if not any(t in ('script', 'style') for t, _ in self.stack):
            self.text.append(data)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('dom')
    p.add_argument('log')
    p.add_argument('--expect-chart', action='append', default=[])
    p.add_argument('--expect-nodata', action='append', default=[])
    p.add_argument('--expect-text', action='append', default=[])
    p.add_argument('--runs', type=int)
    args = p.parse_args()

    dom = Dom()
    dom.feed(open(args.dom, encoding='utf-8').read())
    log = open(args.log, encoding='utf-8', errors='replace').read()
    text = ' '.join(' '.join(dom.text).split())
    failures = []
    if dom.body.get('data-rendered') != 'ok':
        failures.append(f'body data-rendered is {dom.body.get("data-rendered")!r}, not "ok": the page script did not '
                        'finish cleanly')
    if dom.page_errors.strip():
        failures.append(f'#page-errors is not empty: {dom.page_errors.strip()[:600]}')
    console = [l for l in log.splitlines() if 'CONSOLE' in l]
    if console:
        failures.append(f'{len(console)} console message(s), first: {console[0][:400]}')
    for f in dom.figures:
        if 'failed' in f['class']:
            failures.append(f'chart {f["id"]} failed to draw')
    for s in dom.svgs:
        if not s['points'] or not s['points'].isdigit() or int(s['points']) <= 0:
            failures.append(f'chart {s["id"]} has data-points={s["points"]!r}: nothing drawn')
        elif s['marks'] == 0:
            failures.append(f'chart {s["id"]} has no path, rect or circle')
    drawn = {s['id'] for s in dom.svgs if s['points'] and s['points'].isdigit() and int(s['points']) > 0}
    for want in args.expect_chart:
        if want not in drawn:
            failures.append(f'chart {want} was not drawn (drawn: {sorted(drawn)})')
    nodata = {f['id'] for f in dom.figures if 'nodata' in f['class']}
    for want in args.expect_nodata:
        if want not in nodata:
            failures.append(f'chart {want} should show its "no ... events" note')
    for want in args.expect_text:
        if want not in text:
            failures.append(f'text not in the rendered page: {want!r}')
    if args.runs is not None and dom.rows != args.runs:
        failures.append(f'the table has {dom.rows} rows, expected {args.runs}')
    for f in failures:
        print(f'FAIL {args.dom}: {f}')
    print(f'{args.dom}: {len(dom.svgs)} charts drawn '
          f'({sum(int(s["points"] or 0) for s in dom.svgs if (s["points"] or "").isdigit())} marks), '
          f'{len(nodata)} no-data notes, {dom.rows} table rows, {len(failures)} failures')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
