-- kvwatch's per-request accounting run inside nginx (lua-nginx-module, Debian's
-- libnginx-mod-http-lua): a measured prototype for the bench's "nginxlua" target, not shipped.
--
-- It asks what a data plane that is nginx would cost: nginx relays the bytes, this module does
-- what kvwatch's RequestMeter does (kvwatch/requests/accounting.py) and hands the agent the same
-- messages a relay worker sends (kvwatch/requests/proxy/channel.py): in-flight start, progress and
-- finish, the finished RequestRecord, the usage calibration. The bench's meter role decodes them
-- with the agent's own ChannelReceiver, so a record this module gets wrong is refused there.
--
-- Per chunk it never makes a Lua string: ngx.arg[1] would intern every chunk, and SSE chunks alike
-- but for a few digits collide in LuaJIT's string hash (memcmp was 13% of the worker's time). The
-- chain's bytes are read through the FFI call lua-resty-core's own ngx.arg uses, and searched with
-- memmem. A chunk that is not one plain token event (role, finish, usage chunks, events split
-- across reads) takes the slower path with a Lua string, a few times a request.
--
-- Left out, on purpose, as a prototype: retrying without include_usage when the engine refuses
-- it, moving vLLM's system_fingerprint back from the removed usage chunk, and learning model
-- names from the engine. docs/performance.md says what each would take.

local ffi = require "ffi"
local base = require "resty.core.base"
local cjson = require "cjson.safe"

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } kvw_timespec;
int clock_gettime(int clk, kvw_timespec *tp);
void *memmem(const void *haystack, size_t hlen, const void *needle, size_t nlen);
typedef struct { unsigned short sun_family; char sun_path[108]; } kvw_sockaddr_un;
int socket(int domain, int type, int protocol);
int connect(int fd, const void *addr, unsigned int len);
long send(int fd, const void *buf, size_t len, int flags);
int getpid(void);
]]

local C = ffi.C
local get_request = base.get_request
local get_string_buf = base.get_string_buf
local FFI_AGAIN = base.FFI_AGAIN
local cast, ffi_string = ffi.cast, ffi.string
local find, match, format, concat = string.find, string.match, string.format, table.concat
local tonumber, tostring = tonumber, tostring

local CLOCK_MONOTONIC = 1
local AF_UNIX, SOCK_DGRAM, SOCK_NONBLOCK = 1, 2, 2048
local MSG_DONTWAIT, EAGAIN = 0x40, 11
local MAX_DATAGRAM = 60000
local MAX_BACKLOG = 32 * 1024 * 1024
local MAX_JSON_BODY = 1024 * 1024
local FLUSH_EVERY = 0.1 -- seconds: messages of one tick go out together (0.02: +1.0-2.5 µs per chunk, docs)
local PROGRESS_EVERY = 1.0 -- live chunk counts; a scrape every 15 s needs no more (0.1: channel.py's)

local ts = ffi.new("kvw_timespec")
local data_p = ffi.new("unsigned char*[1]")
local len_p = ffi.new("size_t[1]")
local u8p = ffi.typeof("unsigned char*")

local LF2, CRLF2 = "\n\n", "\r\n\r\n"
local COMPACT = '"content":"'
local FINISH_MARK, USAGE_MARK = '"finish_reason"', '"usage"'
local QUOTE = 34

local M = {}
local cfg -- set by configure()
local sock = -1
local queue, queued_bytes = {}, 0 -- messages (JSON text) waiting for the next flush
local backlog, backlog_bytes = {}, 0 -- datagrams the socket would not take yet
local open = {} -- handle -> ctx, for progress
local next_handle, handle_base = 0, 0

local function now()
  C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

-- ---------------------------------------------------------------------------------------------
-- configuration (init_by_lua) and the worker's socket (init_worker_by_lua)
-- ---------------------------------------------------------------------------------------------

--- conf: socket (path), replica, models (served names), default_model, gap_bounds, band_edges,
--- band_names: what the agent's config says; the bench's nginx config writes it as JSON.
function M.configure(json)
  cfg = assert(cjson.decode(json))
  cfg.known = {}
  for _, name in ipairs(cfg.models) do cfg.known[name] = true end
  cfg.nbounds = #cfg.gap_bounds
  local bounds = {}
  for i, b in ipairs(cfg.gap_bounds) do bounds[i] = format("%.17g", b) end
  cfg.gap_bounds_json = "[" .. concat(bounds, ",") .. "]"
end

local function send_datagram(datagram)
  if sock < 0 then return false end
  local n = C.send(sock, datagram, #datagram, MSG_DONTWAIT)
  return n >= 0 or ffi.errno() ~= EAGAIN
end

local function flush()
  while backlog[1] do
    if not send_datagram(backlog[1]) then break end
    backlog_bytes = backlog_bytes - #backlog[1]
    table.remove(backlog, 1)
  end
  if queue[1] == nil then return end
  local batch, size = {}, 2
  local function out()
    local datagram = "[" .. concat(batch, ",") .. "]"
    if backlog[1] or not send_datagram(datagram) then
      backlog[#backlog + 1] = datagram
      backlog_bytes = backlog_bytes + #datagram
    end
  end
  for i = 1, #queue do
    local m = queue[i]
    if batch[1] and size + #m + 1 > MAX_DATAGRAM then
      out()
      batch, size = {}, 2
    end
    batch[#batch + 1] = m
    size = size + #m + 1
  end
  out()
  queue, queued_bytes = {}, 0
end

local function progress()
  for handle, ctx in pairs(open) do
    if ctx.chunks ~= ctx.sent_chunks then
      ctx.sent_chunks = ctx.chunks
      queue[#queue + 1] = format('["p",%d,%d]', handle, ctx.chunks)
    end
  end
end

function M.init_worker()
  handle_base = C.getpid() * 16777216
  sock = C.socket(AF_UNIX, SOCK_DGRAM + SOCK_NONBLOCK, 0)
  local addr = ffi.new("kvw_sockaddr_un")
  addr.sun_family = AF_UNIX
  ffi.copy(addr.sun_path, cfg.socket)
  if C.connect(sock, addr, ffi.sizeof(addr)) ~= 0 then
    ngx.log(ngx.ERR, "kvwatch meter: cannot reach the agent at ", cfg.socket, " (errno ", ffi.errno(), ")")
  end
  -- on a graceful stop (SIGQUIT) nginx runs pending timers early: the last messages still go out
  ngx.timer.every(FLUSH_EVERY, flush)
  ngx.timer.every(PROGRESS_EVERY, function(premature)
    if not premature then progress() end
  end)
end

local function enqueue(message, lost_replica)
  if backlog_bytes > MAX_BACKLOG and lost_replica then
    message = format('["c","kvwatch_proxy_worker_records_lost",[%s,"backlog"],1]', lost_replica)
  end
  queue[#queue + 1] = message
  queued_bytes = queued_bytes + #message
  if queued_bytes > MAX_DATAGRAM then flush() end
end

-- ---------------------------------------------------------------------------------------------
-- JSON text of the channel's messages (field order: RequestRecord, InFlightRequest)
-- ---------------------------------------------------------------------------------------------

local NULL = "null"

local function str(s) return s == nil and NULL or cjson.encode(s) end
local function int(n) return n == nil and NULL or format("%d", n) end
local function num(x) return x == nil and NULL or format("%.17g", x) end
local function bool(b) return b and "true" or "false" end

local function band_for(tokens)
  if tokens == nil then return "unknown" end
  local i = 1
  for _, edge in ipairs(cfg.band_edges) do
    if tokens < edge then break end
    i = i + 1
  end
  return cfg.band_names[i]
end

-- ---------------------------------------------------------------------------------------------
-- the request (access phase): what the client asked for, read once (RequestInfo)
-- ---------------------------------------------------------------------------------------------

local MAX_COUNT = 2147483648 -- values.MAX_COUNT (2**31): a count past it is not recorded

local function count(v)
  if type(v) == "number" and v >= 0 and v == math.floor(v) and v <= MAX_COUNT then return v end
  return nil
end

local function positive_int(v)
  local n = count(v)
  return n ~= nil and n > 0 and n or nil
end

local function lax_true(v)
  if type(v) == "string" then
    local s = v:lower()
    return s == "true" or s == "1" or s == "yes" or s == "on" or s == "t" or s == "y"
  end
  return v == true or v == 1
end

function M.access()
  local uri = ngx.var.uri
  local endpoint = find(uri, "/chat/completions", 1, true) and "chat"
    or (find(uri, "/completions", 1, true) and "completions")
  if not endpoint or ngx.req.get_method() ~= "POST" then return end
  local ctx = ngx.ctx
  ctx.t0 = now()
  ctx.started_at = ngx.req.start_time()
  ctx.endpoint = endpoint
  ngx.req.read_body()
  local body = ngx.req.get_body_data()
  local doc = body and cjson.decode(body)
  local model, limit, options
  if type(doc) == "table" then
    model = doc.model
    limit = doc.max_completion_tokens
    if limit == nil then limit = doc.max_tokens end
    ctx.streaming = doc.stream == true
    options = doc.stream_options
  else
    ctx.streaming = false
  end
  ctx.max_tokens = positive_int(limit)
  ctx.wants_usage = type(options) == "table" and lax_true(options.include_usage)
  -- as body_requesting_usage: a streaming JSON object with one choice and no stream_options gets
  -- "stream_options":{"include_usage":true} after its opening brace, every other byte as sent
  -- (unlike the proxy, nothing is retried when the engine refuses the field)
  if cfg.inject_usage and ctx.streaming and options == nil and (doc.n == nil or doc.n == 1)
    and find(body, "^[ \t\r\n]*{") then
    local brace = find(body, "{", 1, true)
    ngx.req.set_body_data(body:sub(1, brace) .. '"stream_options":{"include_usage":true},' .. body:sub(brace + 1))
    ctx.injected = true
  end
  if type(model) ~= "string" then
    ctx.model = cfg.default_model or "other"
  else
    ctx.model = cfg.known[model] and model or "other"
  end
  ctx.chunks, ctx.sent_chunks, ctx.gap_sum, ctx.max_gap = 0, 0, 0, 0
  ctx.bins = {}
  for i = 1, cfg.nbounds + 1 do ctx.bins[i] = 0 end
  next_handle = next_handle + 1
  local handle = handle_base + next_handle
  ctx.handle = handle
  open[handle] = ctx
  local prompt_estimate = body and math.floor(#body / 4) or 0
  enqueue(format('["s",%d,[%s,%s,%s,%d,0,%s,%s]]', handle, str(cfg.replica), str(ctx.model),
    str(band_for(ctx.max_tokens)), prompt_estimate, num(ctx.started_at), int(ctx.max_tokens)))
end

-- ---------------------------------------------------------------------------------------------
-- the response (body filter): events, content, gaps
-- ---------------------------------------------------------------------------------------------

local function on_content(ctx, n, t)
  local bins = ctx.bins
  if ctx.first == nil then
    ctx.first = t
    bins[1] = bins[1] + n - 1
  else
    local gap = t - ctx.last
    local bounds, k = cfg.gap_bounds, cfg.nbounds + 1
    for i = 1, cfg.nbounds do
      if gap <= bounds[i] then k = i break end
    end
    bins[k] = bins[k] + 1
    bins[1] = bins[1] + n - 1
    ctx.gap_sum = ctx.gap_sum + gap
    if gap > ctx.max_gap then
      ctx.max_gap = gap
      ctx.max_gap_end = t
    end
  end
  ctx.last = t
  ctx.chunks = ctx.chunks + n
end

--- one event's text (a Lua string): content-bearing, finish reason, usage (sse.py's rules)
local function read_event(ctx, event)
  local content = false
  local at = find(event, COMPACT, 1, true)
  if at and event:byte(at + 11) and event:byte(at + 11) ~= QUOTE then
    content = true
  elseif match(event, '"content"[ \t]*:[ \t]*"[^"]') or match(event, '"text"[ \t]*:[ \t]*"[^"]')
    or match(event, '"reasoning_content"[ \t]*:[ \t]*"[^"]') or match(event, '"reasoning"[ \t]*:[ \t]*"[^"]')
    or match(event, '"tool_calls"[ \t]*:[ \t]*%[[ \t]*{') then
    content = true
  end
  if find(event, FINISH_MARK, 1, true) then
    local reason = match(event, '"finish_reason"[ \t]*:[ \t]*"([%w_%-]+)"')
    if reason and #reason <= 32 and ctx.finish_reason ~= "length" then ctx.finish_reason = reason end
  end
  if find(event, USAGE_MARK, 1, true) then
    local data = {}
    for line in event:gmatch("[^\r\n]+") do
      if line:sub(1, 5) == "data:" then
        data[#data + 1] = line:sub(6):gsub("^ ", "")
      end
    end
    local doc = cjson.decode(concat(data, "\n"))
    local usage = type(doc) == "table" and doc.usage
    if type(usage) == "table" then
      ctx.prompt_tokens = count(usage.prompt_tokens)
      ctx.completion_tokens = count(usage.completion_tokens)
    end
  end
  return content
end

--- complete events in a Lua string (the slower path): returns what is left after the last one
--- the chunk include_usage adds (sse.is_usage_only): a usage object and "choices":[]
local function usage_only(event)
  return match(event, '"usage"[ \t]*:[ \t]*{') ~= nil and match(event, '"choices"[ \t]*:[ \t]*%[[ \t]*%]') ~= nil
end

--- complete events in a Lua string (the slower path). Returns what is left after the last one
--- and, where this module asked for usage, the text to send instead (without the usage chunk).
local function read_events(ctx, text, t)
  local sep = ctx.sep
  if sep == nil then
    sep = find(text, CRLF2, 1, true) and CRLF2 or LF2
    ctx.sep = sep
  end
  local pos, n = 1, 0
  local kept = ctx.injected and {} or nil
  while true do
    local at = find(text, sep, pos, true)
    if not at then break end
    local event = text:sub(pos, at - 1)
    if read_event(ctx, event) then n = n + 1 end
    if kept and not usage_only(event) then kept[#kept + 1] = event .. sep end
    pos = at + #sep
  end
  if n > 0 then on_content(ctx, n, t) end
  return pos <= #text and text:sub(pos) or nil, kept and concat(kept) or nil
end

--- the slower path for one read: with usage asked for by this module, the client gets the events
--- but the usage chunk, and an incomplete event waits for the rest (it might be that chunk)
local function read_slowly(ctx, text, t)
  local rest, kept = read_events(ctx, text, t)
  ctx.carry = rest
  if kept then ngx.arg[1] = kept end
end

local SPACE, TAB, COLON = 32, 9, 58

--- whether a finish reason in p[0, n) has a string value (sse.FINISH): ``"finish_reason":null``,
--- on every token chunk vLLM writes, does not
local function names_a_reason(p, n)
  local at = cast(u8p, C.memmem(p, n, FINISH_MARK, 15))
  if at == nil then return false end
  local stop = p + n
  local q = at + 15
  while q < stop and (q[0] == SPACE or q[0] == TAB) do q = q + 1 end
  if q >= stop or q[0] ~= COLON then return true end -- not the key as written: let the slow path read it
  q = q + 1
  while q < stop and (q[0] == SPACE or q[0] == TAB) do q = q + 1 end
  return q >= stop or q[0] == QUOTE
end

function M.body()
  local ctx = ngx.ctx
  if ctx.t0 == nil then return end
  local r = get_request()
  data_p[0] = nil
  local rc = C.ngx_http_lua_ffi_get_body_filter_param_body(r, data_p, len_p)
  local n = tonumber(len_p[0])
  if n > 0 then
    local p = data_p[0]
    if rc == FFI_AGAIN then
      p = get_string_buf(n)
      C.ngx_http_lua_ffi_copy_body_filter_param_body(r, p)
    end
    local t = now()
    if not ctx.streaming then
      local size = (ctx.body_size or 0) + n
      ctx.body_size = size
      if size <= MAX_JSON_BODY then
        local parts = ctx.parts or {}
        parts[#parts + 1] = ffi_string(p, n)
        ctx.parts = parts
      end
    elseif ctx.carry == nil and ctx.sep == LF2 and n > 2 and p[n - 1] == 10 and p[n - 2] == 10 then
      -- the hot path: one complete plain token event (the compact content marker, nothing else)
      local first = cast(u8p, C.memmem(p, n, LF2, 2))
      local at = cast(u8p, C.memmem(p, n, COMPACT, 11))
      if first == p + n - 2 and at ~= nil and at + 11 < p + n and at[11] ~= QUOTE
        and not names_a_reason(p, n) and C.memmem(p, n, USAGE_MARK, 7) == nil then
        on_content(ctx, 1, t)
      else
        read_slowly(ctx, ffi_string(p, n), t)
      end
    else
      read_slowly(ctx, (ctx.carry or "") .. ffi_string(p, n), t)
    end
  end
  if C.ngx_http_lua_ffi_get_body_filter_param_eof(r) == 1 then
    ctx.eof = true
    if ctx.injected and ctx.carry then -- an incomplete last event: the client gets it as it came
      ngx.arg[1] = (n > 0 and ngx.arg[1] or "") .. ctx.carry
      ctx.carry = nil
    end
  end
end

-- ---------------------------------------------------------------------------------------------
-- the end (log phase): the record, in RequestRecord's field order
-- ---------------------------------------------------------------------------------------------

local function outcome(ctx, status)
  if not ctx.eof then
    -- the last buffer never came: nginx calls the request complete when the engine's stream broke
    -- ("upstream prematurely closed"), not when the client left first
    if status >= 500 or ngx.var.request_completion == "OK" then return "error" end
    return "aborted"
  end
  if status >= 500 then return "error" end
  if status >= 400 then return "rejected" end
  if ctx.finish_reason == "length" then return "truncated" end
  if ctx.finish_reason == "abort" or ctx.finish_reason == "error" then return "error" end
  return "completed"
end

function M.log()
  local ctx = ngx.ctx
  if ctx.t0 == nil then return end
  local t = now()
  open[ctx.handle] = nil
  local status = ngx.status
  if not ctx.streaming and ctx.parts then
    local doc = cjson.decode(concat(ctx.parts))
    if type(doc) == "table" and type(doc.usage) == "table" then
      ctx.prompt_tokens = count(doc.usage.prompt_tokens)
      ctx.completion_tokens = count(doc.usage.completion_tokens)
    end
    if type(doc) == "table" and type(doc.choices) == "table" then
      for _, choice in ipairs(doc.choices) do
        local reason = type(choice) == "table" and choice.finish_reason
        if type(reason) == "string" and ctx.finish_reason ~= "length" then ctx.finish_reason = reason end
      end
    end
  end
  local result = outcome(ctx, status)
  local output, estimated = ctx.completion_tokens, false
  local ended = result == "completed" or result == "truncated"
  if output == nil and ctx.streaming and (ctx.chunks > 0 or ended) then
    output, estimated = ctx.chunks, true
  end
  local gaps = ctx.chunks > 1
  local gap_end = ctx.max_gap_end or ctx.first
  local replica = str(cfg.replica)
  local fields = {
    replica, str(ctx.model), '"proxy"', str(result), num(ctx.started_at), str(ctx.endpoint),
    bool(ctx.streaming), int(status), str(ctx.finish_reason), int(ctx.prompt_tokens), int(output),
    bool(estimated), int(ctx.max_tokens), num(ctx.first and ctx.first - ctx.t0), num(t - ctx.t0),
    NULL, NULL, ctx.streaming and int(ctx.chunks) or NULL,
    gaps and cfg.gap_bounds_json or "[]", gaps and "[" .. concat(ctx.bins, ",") .. "]" or "[]",
    num(gaps and ctx.gap_sum or 0), gaps and num(ctx.max_gap) or NULL,
    (gaps and gap_end) and num(ctx.started_at + (gap_end - ctx.t0)) or NULL,
    NULL, NULL, NULL, "[]", NULL,
    "1",  -- choices: the bench's clients ask one sequence a request (n = 1)
  }
  enqueue('["r",[' .. concat(fields, ",") .. "]]", replica)
  if ctx.completion_tokens and ctx.chunks > 0 then
    enqueue(format('["k",%s,%d,%d]', replica, ctx.completion_tokens, ctx.chunks))
  end
  enqueue(format('["f",%d]', ctx.handle))
end

return M
