# The declaration as HCL-JSON: the shape config.Canonical writes and
# `cagectl validate` reads ({"agent": {"NAME": {...}}, "egress_policy": ...},
# snake_case keys). A pure function of the options: needs only lib.
#
# Nulls are dropped, so unset options take the Go schema's defaults; this file
# renames and nests, it never decides a value.
{ lib, config, ... }:
let
  cfg = config.services.nixcage;

  # Drop nulls (unset options) and empty blocks.
  clean = attrs: lib.filterAttrs (_: v: v != null && v != { }) attrs;

  policy = p: clean {
    inherit (p) allow deny inspect ports;
    rate_limit = lib.mapNullable (r: clean { per_second = r.perSecond; inherit (r) burst; }) p.rateLimit;
    inspector = lib.mapAttrs (_: i: clean {
      inherit (i) action threshold;
      max_bytes = i.maxBytes;
      min_length = i.minLength;
    }) p.inspectors;
    limits = lib.mapNullable (l: clean {
      max_tunnels = l.maxTunnels;
      max_header_bytes = l.maxHeaderBytes;
      max_body_bytes = l.maxBodyBytes;
      idle_timeout = l.idleTimeout;
    }) p.limits;
    dns = lib.mapNullable (d: clean {
      inherit (d) enabled;
      allow_types = d.allowTypes;
      deny_types = d.denyTypes;
      max_label_length = d.maxLabelLength;
    }) p.dns;
    credential = lib.mapAttrs (_: c: clean { inherit (c) hosts header; }) p.credentials;
    inherit (p) websocket;
    http_rule = lib.mapAttrs (_: r: clean { inherit (r) hosts methods paths action; }) p.httpRules;
    unsafe_allow_loopback_upstreams = p.unsafeAllowLoopbackUpstreams;
    unsafe_allow_private_upstreams = p.unsafeAllowPrivateUpstreams;
  };

  agent = a: clean {
    inherit (a) backend command environment workspace tools image autostart interactive egress harness learn;
    learn_for = a.learnFor;
    turn_command = a.turnCommand;
    turn_timeout = a.turnTimeout;
    # A list, so an approval block with every default (an empty one) stays
    # a block in the JSON rather than being cleaned away.
    approval = lib.mapNullable (ap: [ (clean { inherit (ap) wait; max_pending = ap.maxPending; }) ]) a.approval;
    egress_policy = lib.mapNullable policy a.egressPolicy;
    secret = lib.mapAttrs (_: s: clean { inherit (s) source env hosts header; }) a.secrets;
    resources = lib.mapNullable clean a.resources;
  };

  declared = clean {
    version = 1;
    agent = lib.mapAttrs (_: agent) cfg.agents;
    egress_policy = lib.mapAttrs (_: policy) cfg.egressPolicies;
    account = lib.mapAttrs (_: a: clean { inherit (a) user group role agents; }) cfg.accounts;
    store = lib.mapNullable (s: clean {
      inherit (s) root channel keys threshold generations;
      nix_keys = s.nixKeys;
      expiry_warning = s.expiryWarning;
      root_keys = s.rootKeys;
      root_threshold = s.rootThreshold;
    }) cfg.store;
    evidence = lib.mapNullable (e: clean {
      max_bytes = e.maxBytes;
      max_entries = e.maxEntries;
      max_duration = e.maxDuration;
    }) cfg.evidence;
    # A list of one block: an empty block (the default listen) must not be
    # dropped by clean, or metrics would silently stay off.
    metrics = lib.mapNullable (m: [ (clean { inherit (m) listen; }) ]) cfg.metrics;
    control = lib.mapNullable (c: clean {
      inherit (c) keys threshold;
      host_id = c.hostId;
      ack_url = c.ackUrl;
    }) cfg.control;
    relay = lib.mapNullable (r: clean {
      token_file = r.tokenFile;
      inherit (r) owners account;
      api_url = r.apiUrl;
      max_file_bytes = r.maxFileBytes;
      chat = lib.mapAttrs (_: c: clean { chat_id = c.chatId; inherit (c) topic; }) r.chats;
    }) cfg.relay;
    channel = lib.mapNullable (c: clean {
      inherit (c) url interval;
      ca_file = c.caFile;
    }) cfg.channel;
  };
in
{
  config.services.nixcage.model = lib.recursiveUpdate declared cfg.settings;
}
