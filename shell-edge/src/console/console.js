// The iop console: signs in with an admin key (POST /console/session sets an
// HttpOnly session cookie; the key is kept nowhere), then follows the Edge's
// status document over server-sent events (GET /console/events) and renders
// it. Every value is written with textContent: nothing from the Edge is
// parsed as HTML. A part of the document this page does not know is shown
// as a generic table, so a newer Edge's sections still appear.
'use strict';

(function () {
  const $ = (id) => document.getElementById(id);

  let source = null;      // the EventSource, while following
  let lastAt = 0;         // when the last document arrived (local ms)
  let retry = null;       // a pending reconnect

  // ---- small DOM helpers --------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') node.className = v;
      else if (k === 'text') node.textContent = String(v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function badge(text, kind) {
    return el('span', { class: 'badge ' + (kind || ''), text });
  }

  function empty(text) {
    return el('p', { class: 'empty', text });
  }

  // A table of `rows` (arrays of cells) under `columns` ([label, numeric?,
  // title]); `key(row, i)` names each row for the data-key attribute.
  function table(columns, rows, rowAttrs) {
    const head = el('tr', {}, columns.map(([label, num, title]) =>
      el('th', { class: num ? 'num' : null, title: title || null, text: label })));
    const body = rows.map((cells, i) => el('tr', rowAttrs ? rowAttrs(i) : {},
      cells.map((cell, c) => el('td', {
        class: columns[c][1] ? 'num' : null,
        'data-label': columns[c][0],
      }, cell === null || cell === undefined ? '–' : cell))));
    return el('table', { class: 'rows' }, el('thead', {}, head), el('tbody', {}, body));
  }

  function replace(id, ...nodes) {
    const target = $(id);
    target.replaceChildren(...nodes);
  }

  // ---- formatting ---------------------------------------------------------

  // An age from the Edge's clock: "3 s", "5 min", "2 h", "4 d".
  function span(ms) {
    if (ms === null || ms === undefined || ms < 0) return '–';
    const s = Math.floor(ms / 1000);
    if (s < 1) return 'now';
    if (s < 120) return s + ' s';
    if (s < 7200) return Math.floor(s / 60) + ' min';
    if (s < 172800) return Math.floor(s / 3600) + ' h';
    return Math.floor(s / 86400) + ' d';
  }
  // A duration: "12 ms" under a second, then as `span`.
  function dur(ms) {
    if (typeof ms !== 'number' || ms < 0) return '–';
    return ms < 1000 ? Math.round(ms) + ' ms' : span(ms);
  }
  function ago(now, at) {
    if (typeof at !== 'number') return '–';
    if (at > now) return 'in ' + span(at - now);
    const t = span(now - at);
    return t === 'now' ? 'now' : t + ' ago';
  }
  function count(n) {
    if (typeof n !== 'number') return '–';
    return n.toLocaleString('en-US');
  }
  function bytes(n) {
    if (typeof n !== 'number') return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n : n.toFixed(1)) + ' ' + units[i];
  }
  function meter(used, cap) {
    const ratio = cap > 0 ? Math.min(1, used / cap) : 0;
    const step = Math.round(ratio * 10) * 10;
    return el('span', {},
      el('span', { class: 'meter' + (cap > 0 && used >= cap ? ' full' : '') },
        el('span', { class: 'w' + step })),
      used + ' / ' + cap);
  }

  // ---- sections -----------------------------------------------------------

  function renderSummary(doc) {
    const i = doc.instance || {};
    const nodes = Array.isArray(doc.nodes) ? doc.nodes : [];
    const providers = Array.isArray(doc.providers) ? doc.providers : [];
    const healthy = providers.filter((p) => p.state === 'ok' && p.overlay !== 'lowered').length;
    const journal = doc.journal || {};
    const tile = (id, label, value, sub) => el('div', { class: 'tile', id },
      el('div', { class: 'label', text: label }),
      el('div', { class: 'value', text: value }),
      sub ? el('div', { class: 'sub', text: sub }) : null);
    replace('summary',
      tile('tile-nodes', 'Nodes connected', count(i.nodes_connected),
        nodes.length ? 'of ' + nodes.length + ' known' : null),
      tile('tile-providers', 'Providers healthy', count(healthy), 'of ' + providers.length),
      tile('tile-in-flight', 'Requests in flight', count(i.requests_in_flight),
        'queued: ' + count(i.queue_depth)),
      tile('tile-served', 'Requests served', count(i.requests_finished),
        typeof i.requests_ok === 'number' ? count(i.requests_ok) + ' ok' : null),
      tile('tile-leases', 'Capacity in use', count(i.leases_in_use), 'leases held'),
      tile('tile-tokens', 'Tokens', count((i.input_tokens || 0) + (i.output_tokens || 0)),
        'in ' + count(i.input_tokens) + ' · out ' + count(i.output_tokens)),
      tile('tile-journal', 'Journal', journal.state || '–',
        journal.store ? journal.store + ' · ' + count(journal.records) + ' records' : null));
    $('edge').textContent = [i.edge_id, i.version ? 'v' + i.version : null]
      .filter(Boolean).join(' · ');
  }

  function nodeState(n) {
    if (n.ready) return badge('ready', 'ok');
    if (n.connected) return badge('connecting', 'warn');
    return badge('disconnected', 'bad');
  }

  function renderNodes(doc, now) {
    const nodes = Array.isArray(doc.nodes) ? doc.nodes : [];
    if (!nodes.length) {
      replace('nodes', empty('No node is configured or connected yet.'));
      return;
    }
    const rows = nodes.map((n) => [
      n.node,
      nodeState(n),
      n.generation === null ? '–' : String(n.generation),
      n.connected ? span(now - n.connected_since) : '–',
      typeof n.rtt_ms === 'number' ? n.rtt_ms + ' ms' : '–',
      typeof n.lost_packets === 'number'
        ? count(n.lost_packets) + ' of ' + count(n.sent_packets) +
          (typeof n.loss_ratio === 'number' ? ' (' + (n.loss_ratio * 100).toFixed(1) + ' %)' : '')
        : '–',
      n.last_close_reason ? n.last_close_reason + ', ' + ago(now, n.last_close_at) : '–',
    ]);
    replace('nodes', table([
      ['Node'], ['State'], ['Generation', true, 'A new connection gets a higher generation'],
      ['Connected for'], ['Round trip', true], ['Packets lost', true],
      ['Last connection ended', false, 'Why the previous connection closed'],
    ], rows, (i) => ({ 'data-node': nodes[i].node, 'data-state': nodes[i].ready ? 'ready' : (nodes[i].connected ? 'connecting' : 'disconnected') })));
  }

  function healthBadge(state) {
    const kinds = { ok: 'ok', unknown: '', stale: 'warn', unavailable: 'bad' };
    return badge(state || 'unknown', kinds[state] || '');
  }

  function renderProviders(doc, now) {
    const providers = Array.isArray(doc.providers) ? doc.providers : [];
    if (!providers.length) {
      replace('providers', empty('No provider is configured.'));
      return;
    }
    const rows = providers.map((p) => [
      p.id,
      el('span', {}, p.node, p.node_ready ? null : el('span', { class: 'muted', text: ' (down)' })),
      p.adapter + (p.mode === 'tunnel' ? ' · tunnel' : ''),
      healthBadge(p.state),
      p.overlay === 'lowered' ? badge('lowered', 'bad') : badge('clear', 'ok'),
      meter(p.leases_in_use || 0, p.capacity || 0),
      String(p.consecutive_failures || 0) + (p.failure_code ? ' · ' + p.failure_code : ''),
      ago(now, p.last_success_at),
      ago(now, p.next_retry_at),
    ]);
    replace('providers', table([
      ['Provider'], ['Node'], ['Adapter'], ['Health', false, 'From the Edge\'s probes'],
      ['Overlay', false, 'Lowered after a stall mid-answer; cleared when it recovers'],
      ['In use', false, 'Leases held / capacity'], ['Failures', true], ['Last success'], ['Next retry'],
    ], rows, (i) => ({ 'data-provider': providers[i].id, 'data-health': providers[i].state })));
  }

  function phaseBadge(phase, committed) {
    const kinds = { queued: 'warn', sending: '', running: 'ok', parked: 'bad', settling: '' };
    return badge(phase + (committed && phase === 'running' ? ' · streaming' : ''), kinds[phase] || '');
  }

  function renderRequests(doc, now) {
    const r = doc.requests || {};
    const listed = Array.isArray(r.listed) ? r.listed : [];
    if (!listed.length) {
      replace('requests', empty('No request is running.'));
      return;
    }
    const rows = listed.map((q) => [
      q.route,
      el('span', { class: 'mono', text: q.model }),
      phaseBadge(q.phase, q.committed),
      String(q.attempt || 0),
      q.provider || '–',
      dur(q.age_ms),
      dur(q.queued_ms),
      q.response ? el('span', { class: 'mono', text: q.response }) : '–',
    ]);
    const nodes = [table([
      ['Route'], ['Model'], ['Phase'], ['Attempt', true], ['Provider'], ['Age'],
      ['Queued', false, 'Time spent waiting for capacity'], ['Durable response'],
    ], rows, (i) => ({ 'data-request': i, 'data-phase': listed[i].phase }))];
    if (r.in_flight > listed.length) {
      nodes.push(el('p', { class: 'help', text: 'Showing the oldest ' + listed.length + ' of ' + r.in_flight + '.' }));
    }
    replace('requests', ...nodes);
  }

  function statusBadge(status) {
    const kinds = { completed: 'ok', in_progress: 'warn', incomplete: 'warn', failed: 'bad', cancelled: '' };
    return badge(status || 'unknown', kinds[status] || '');
  }

  function renderDurable(doc, now) {
    const d = doc.durable_responses || {};
    const recent = Array.isArray(d.recent) ? d.recent : [];
    if (!recent.length) {
      replace('durable', empty('This Edge has not run a durable response since it started.'));
    } else {
      replace('durable', table([
        ['Response', false, 'The tag the logs name it by (not its id)'], ['Status'], ['Owner Edge', false, 'The Edge that writes the record'],
        ['Events', true], ['API'], ['Running here'], ['Created'],
      ], recent.map((r) => [
        el('span', { class: 'mono', text: r.tag }),
        statusBadge(r.status),
        r.owner === undefined || r.owner === null ? '–' : (r.owner === '' ? '(first Edge)' : r.owner),
        count(r.events),
        r.api || '–',
        r.live_here ? 'yes' : 'no',
        ago(now, r.created_at),
      ]), (i) => ({ 'data-response': recent[i].tag })));
    }
    const j = doc.journal;
    if (!j || typeof j !== 'object') {
      replace('journal');
      return;
    }
    const parts = [el('h3', { text: 'Journal' }), el('dl', { class: 'kv' },
      el('dt', { text: 'Store' }), el('dd', { text: j.store || '–' }),
      el('dt', { text: 'State' }), el('dd', {}, badge(j.state || 'unknown', j.state === 'ok' ? 'ok' : (j.state === 'failing' ? 'bad' : ''))),
      el('dt', { text: 'Records' }), el('dd', { text: count(j.records) + ' · ' + bytes(j.bytes) }),
      el('dt', { text: 'Waiting for takeover' }), el('dd', { text: count(j.orphans_waiting) }),
      ...(j.durable_backlog ? [el('dt', { text: 'Durable requests' }),
        el('dd', {}, badge('refused until the responses an outage cut are ended', 'bad'))] : []),
      el('dt', { text: 'Last error' }), el('dd', { text: j.last_error ? j.last_error + ', ' + ago(now, j.last_error_at) : 'none' }))];
    const edges = Array.isArray(j.edges) ? j.edges : [];
    if (edges.length) {
      parts.push(table([['Edge'], ['Lease'], ['Renewed'], ['TTL', true]], edges.map((e) => [
        e.edge_id + (e.this_edge ? ' (this one)' : ''), e.state, ago(now, e.renewed_at),
        typeof e.ttl_ms === 'number' ? span(e.ttl_ms) : '–',
      ])));
    }
    replace('journal', ...parts);
  }

  function limitText(l) {
    if (!l) return ['–', '–', '–', '–'];
    const n = (v) => (typeof v === 'number' ? count(v) : 'no limit');
    const budget = l.budget
      ? money(l.budget.limit_micros) + ' per ' + String(l.budget.period).toLowerCase()
      : 'no limit';
    return [n(l.requests_per_minute), n(l.tokens_per_minute), n(l.concurrent_requests), budget];
  }
  function money(micros) {
    return typeof micros === 'number' ? (micros / 1e6).toLocaleString('en-US', { maximumFractionDigits: 6 }) : '–';
  }

  // Keys and principals with their limits (`limits`), and what they used
  // today and the tenants' store (`tenants`), when the Edge reports them.
  function renderTenants(doc) {
    const parts = [];
    const limits = doc.limits || {};
    const tenants = doc.tenants && typeof doc.tenants === 'object' ? doc.tenants : null;
    const keys = Array.isArray(limits.keys) ? limits.keys : [];
    const configured = Array.isArray(limits.principals) ? limits.principals : [];
    const today = tenants && tenants.today && tenants.today.principals &&
      typeof tenants.today.principals === 'object' && !tenants.today.principals.error
      ? tenants.today.principals : {};
    const limitCols = [['Requests / min', true], ['Tokens / min', true], ['Concurrent', true], ['Budget', true]];

    const names = [...new Set(configured.map((p) => p.principal).concat(Object.keys(today)))].sort();
    if (names.length) {
      const byName = Object.fromEntries(configured.map((p) => [p.principal, p.limits]));
      parts.push(el('h3', { text: 'Principals: used today against their limits' }), el('div', { class: 'scroll' }, table(
        [['Principal'], ['Requests today', true], ['Tokens in', true], ['Tokens out', true], ['Spend', true]].concat(limitCols),
        names.map((name) => {
          const t = today[name] || {};
          return [name, count(t.requests || 0), count(t.input_tokens || 0), count(t.output_tokens || 0),
            money(t.spend_micros || 0)].concat(limitText(byName[name]));
        }),
        (i) => ({ 'data-principal': names[i] }))));
    }
    if (keys.length) {
      const stateKind = { usable: 'ok', revoked: 'bad', expired: 'warn' };
      parts.push(el('h3', { text: 'Keys' }), el('div', { class: 'scroll' }, table(
        [['Key id'], ['Principal'], ['From'], ['State'], ['Admin'], ['Models']].concat(limitCols),
        keys.map((k) => [k.id, k.principal, k.source || '–', badge(k.state || 'usable', stateKind[k.state] || ''),
          k.admin ? 'yes' : 'no', Array.isArray(k.models) ? k.models.join(', ') : '–'].concat(limitText(k.limits))),
        (i) => ({ 'data-key-id': keys[i].id }))));
      if (limits.keys_total > keys.length) {
        parts.push(el('p', { class: 'help', text: 'Showing ' + keys.length + ' of ' + limits.keys_total + ' keys.' }));
      }
    }
    if (tenants) {
      const k = tenants.keys || {};
      const store = el('dl', { class: 'kv' },
        el('dt', { text: 'Tenants\' store' }),
        el('dd', {}, tenants.store_reachable === false ? badge('unreachable', 'bad') : badge('reachable', 'ok')),
        el('dt', { text: 'Limit checks' }),
        el('dd', { text: count(tenants.claims) + ' (' + count(tenants.claim_failures) + ' failed)' }),
        el('dt', { text: 'Usage writes' }),
        el('dd', { text: count(tenants.usage_writes) + ' (' + count(tenants.usage_write_failures) + ' failed)' }),
        el('dt', { text: 'Runtime keys' }),
        el('dd', { text: count(k.runtime_keys) + ' (' + count(k.runtime_keys_usable) + ' usable), ' +
          count(k.config_keys) + ' from the config file' }));
      parts.push(el('h3', { text: 'Store' }), store);
      if (tenants.today && tenants.today.principals && tenants.today.principals.error) {
        parts.push(el('p', { class: 'error', text: 'Usage: ' + tenants.today.principals.error }));
      }
    }
    if (!parts.length) parts.push(empty('No API keys are configured.'));
    replace('tenants', ...parts);
  }

  // Any JSON value: scalars as text, arrays of objects as tables, objects as
  // label/value lists (nested a few levels at most).
  function generic(value, depth) {
    if (value === null || typeof value !== 'object') return document.createTextNode(value === null ? '–' : String(value));
    if (depth > 3) return document.createTextNode(JSON.stringify(value));
    if (Array.isArray(value)) {
      if (!value.length) return empty('none');
      if (value.every((v) => v && typeof v === 'object' && !Array.isArray(v))) {
        const columns = [...new Set(value.flatMap((v) => Object.keys(v)))];
        return el('div', { class: 'scroll' }, table(columns.map((c) => [c]),
          value.map((v) => columns.map((c) => cell(v[c], depth + 1)))));
      }
      return document.createTextNode(value.map((v) => (typeof v === 'object' ? JSON.stringify(v) : String(v))).join(', '));
    }
    const dl = el('dl', { class: 'kv' });
    for (const [k, v] of Object.entries(value)) {
      dl.append(el('dt', { text: k }), el('dd', {}, cell(v, depth + 1)));
    }
    return dl;
  }
  function cell(v, depth) {
    if (v === null || v === undefined) return '–';
    if (typeof v === 'object') return generic(v, depth);
    return String(v);
  }

  const KNOWN = new Set(['instance', 'providers', 'journal', 'nodes', 'requests',
    'durable_responses', 'limits', 'tenants']);

  function renderMore(doc) {
    const extra = Object.keys(doc).filter((k) => !KNOWN.has(k));
    $('more-card').hidden = extra.length === 0;
    replace('more', ...extra.flatMap((k) => [el('h3', { text: k }), generic(doc[k], 0)]));
  }

  function render(doc) {
    const now = (doc.instance && doc.instance.now_unix_ms) || Date.now();
    renderSummary(doc);
    renderNodes(doc, now);
    renderProviders(doc, now);
    renderRequests(doc, now);
    renderDurable(doc, now);
    renderTenants(doc);
    renderMore(doc);
    lastAt = Date.now();
    setLive('live', 'ok');
  }

  // ---- connection state ---------------------------------------------------

  function setLive(text, kind) {
    const live = $('live');
    live.textContent = text;
    live.className = 'badge ' + kind;
  }

  setInterval(() => {
    if (!lastAt || $('dashboard').hidden) return;
    const age = Date.now() - lastAt;
    if (age > 5000) setLive('stale · ' + span(age), 'warn');
  }, 1000);

  function showLogin(message) {
    stop();
    $('dashboard').hidden = true;
    $('sign-out').hidden = true;
    $('login').hidden = false;
    $('login-error').textContent = message || '';
    setLive('signed out', 'off');
    $('key').focus();
  }

  function showDashboard() {
    $('login').hidden = true;
    $('dashboard').hidden = false;
    $('sign-out').hidden = false;
  }

  function stop() {
    if (source) { source.close(); source = null; }
    if (retry) { clearTimeout(retry); retry = null; }
  }

  function follow() {
    stop();
    source = new EventSource('/console/events');
    source.addEventListener('status', (e) => {
      try { render(JSON.parse(e.data)); } catch (err) { setLive('bad data', 'bad'); }
    });
    source.addEventListener('expired', () => showLogin('Your session expired. Sign in again.'));
    source.onerror = () => {
      // The browser retries by itself unless the Edge refused the stream;
      // then ask why (signed out, or too many console tabs).
      setLive('reconnecting', 'warn');
      if (source && source.readyState === EventSource.CLOSED) {
        source = null;
        retry = setTimeout(start, 3000);
      }
    };
  }

  // Load once, then follow; a 401 means: sign in.
  async function start() {
    retry = null;
    let r;
    try {
      r = await fetch('/console/status', { credentials: 'same-origin', cache: 'no-store' });
    } catch (err) {
      setLive('offline', 'off');
      retry = setTimeout(start, 3000);
      return;
    }
    if (r.status === 401 || r.status === 403) {
      showLogin($('dashboard').hidden ? '' : 'Your session ended. Sign in again.');
      return;
    }
    if (!r.ok) {
      setLive('error ' + r.status, 'bad');
      retry = setTimeout(start, 3000);
      return;
    }
    showDashboard();
    render(await r.json());
    follow();
  }

  async function signIn(event) {
    event.preventDefault();
    const input = $('key');
    const key = input.value.trim();
    if (!key) return;
    $('login-error').textContent = '';
    let r;
    try {
      r = await fetch('/console/session', {
        method: 'POST',
        credentials: 'same-origin',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ key }),
      });
    } catch (err) {
      $('login-error').textContent = 'The Edge could not be reached.';
      return;
    }
    input.value = '';
    if (r.ok) {
      start();
      return;
    }
    const why = {
      401: 'This Edge does not know that key.',
      403: 'That key works, but it is not an admin key.',
      413: 'That is too long to be a key.',
    };
    $('login-error').textContent = why[r.status] || ('Sign-in failed (' + r.status + ').');
  }

  async function signOut() {
    stop();
    try {
      await fetch('/console/session', { method: 'DELETE', credentials: 'same-origin' });
    } catch (err) { /* signed out locally either way */ }
    showLogin('Signed out.');
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('login-form').addEventListener('submit', signIn);
    $('sign-out').addEventListener('click', signOut);
    start();
  });
})();
