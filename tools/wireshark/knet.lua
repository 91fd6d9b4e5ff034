-- Wireshark dissector for kNet over UDP as knet speaks it (docs/PROTOCOL.md).
--
-- Two dialects share the wire:
--   spec       the specification's layout (datagram.go, message.go, vle.go)
--   reference  the C++ reference implementation's (cppwire.go,
--              testdata/reference/README.md)
-- Preference knet.dialect picks one, or "auto": a conversation that opens
-- with the reference's 8 zero bytes is reference from there on, one whose
-- datagram holds a spec handshake message is spec; anything else is
-- decided datagram by datagram (see choose).
--
-- A second protocol, knetgo_tcp, reads kNet over TCP, the C++
-- reference's framing (docs/PROTOCOL.md, "kNet over TCP";
-- testdata/reference/tcp/README.md): frames of a VLE size, a VLE
-- MessageID and the payload, back to back, reassembled across segments by
-- the size field. It takes TCP ports from its preference (7000 by default),
-- "Decode As", and a heuristic: a stream whose first bytes are a ping
-- (a PingRequest, 02 01 NN, or a PingReply then a PingRequest) or knet's
-- hello.
--
-- Load with: wireshark -X lua_script:tools/wireshark/knet.lua
-- or copy this file into the personal Lua plugins folder.
--
-- Decoding never raises a Lua error on bad input: every read is bounds
-- checked first, and what does not parse is shown as expert info.

local knet = Proto("knetgo", "kNet over UDP (knet-go)")

-- Reserved message IDs (DECISIONS §2; knet uses 5, docs/PROTOCOL.md 4).
local ID_PING_REQUEST = 1
local ID_PING_REPLY = 2
local ID_FLOW_CONTROL = 3
local ID_PACKET_ACK = 4
local ID_ANCHOR = 5
local ID_CONNECT_ACK = 0x3FFFFFFB
local ID_CONNECT_SYN_ACK = 0x3FFFFFFC
local ID_CONNECT_SYN = 0x3FFFFFFD
local ID_DISCONNECT_ACK = 0x3FFFFFFE
local ID_DISCONNECT = 0x3FFFFFFF

local msg_names = {
	[0] = "Reserved0",
	[ID_PING_REQUEST] = "PingRequest",
	[ID_PING_REPLY] = "PingReply",
	[ID_FLOW_CONTROL] = "FlowControlRequest",
	[ID_PACKET_ACK] = "PacketAck",
	[ID_ANCHOR] = "Reserved5",
	[ID_CONNECT_ACK] = "ConnectAck",
	[ID_CONNECT_SYN_ACK] = "ConnectSynAck",
	[ID_CONNECT_SYN] = "ConnectSyn",
	[ID_DISCONNECT_ACK] = "DisconnectAck",
	[ID_DISCONNECT] = "Disconnect",
}

local PID_MOD = 0x400000 -- PacketIDs are 22-bit
local MAX_REL_NUM = 0x7FFFFFFF

local dialect_names = { "auto", "spec", "reference" }
local order_names = {
	[0] = "none",
	[1] = "entry 0",
	[2] = "entry 1",
	[3] = "entry 2",
	[4] = "entry 3",
	[5] = "entry 4",
	[6] = "SingleInOrderIndex",
	[7] = "MultiInOrderIndexArray",
}

local pf = {
	dialect = ProtoField.string("knetgo.dialect", "Dialect"),
	opening = ProtoField.bytes("knetgo.opening", "Reference connection opening (8 zero bytes)"),
	packetid = ProtoField.uint32("knetgo.packetid", "PacketID"),
	-- Spec header: u24, bits 0-21 PacketID, 22 Reliable, 23 InOrder.
	header = ProtoField.uint24("knetgo.header", "Header", base.HEX),
	reliable = ProtoField.bool("knetgo.reliable", "Reliable", 24, nil, 0x400000),
	inorder = ProtoField.bool("knetgo.inorder", "InOrder", 24, nil, 0x800000),
	io_count = ProtoField.uint8("knetgo.inorder.count", "InOrderDeltaCount"),
	io_delta = ProtoField.uint16("knetgo.inorder.delta", "InOrderDelta"),
	io_dep = ProtoField.uint32("knetgo.inorder.dep_packetid", "Depended PacketID"),
	io_index = ProtoField.uint16("knetgo.inorder.index", "InOrderDatagramIndex"),
	-- Reference header: byte 0 bit 7 InOrder, bit 6 Reliable, bits 0-5
	-- PacketID bits 0-5; u16 PacketID bits 6-21; ReliableMsgNumBase.
	ref_flags = ProtoField.uint8("knetgo.ref.flags", "Flags and PacketID bits 0-5", base.HEX),
	ref_inorder = ProtoField.bool("knetgo.ref.inorder", "InOrder", 8, nil, 0x80),
	ref_reliable = ProtoField.bool("knetgo.ref.reliable", "Reliable", 8, nil, 0x40),
	ref_pid_hi = ProtoField.uint16("knetgo.ref.packetid_hi", "PacketID bits 6-21"),
	ref_relbase = ProtoField.uint32("knetgo.ref.relbase", "ReliableMsgNumBase"),
	-- Message block.
	msg = ProtoField.none("knetgo.msg", "Message"),
	msg_index = ProtoField.uint16("knetgo.msg.index", "Index in datagram"),
	msg_header = ProtoField.uint16("knetgo.msg.header", "Message header", base.HEX),
	msg_fragstart = ProtoField.bool("knetgo.msg.fragstart", "FragmentStart", 16, nil, 0x8000),
	msg_fragment = ProtoField.bool("knetgo.msg.fragment", "Fragment", 16, nil, 0x4000),
	msg_order = ProtoField.uint16("knetgo.msg.inorder_code", "InOrder code", base.DEC, order_names, 0x3800),
	msg_ref_inorder = ProtoField.bool("knetgo.msg.ref.inorder", "InOrder", 16, nil, 0x2000),
	msg_ref_reliable = ProtoField.bool("knetgo.msg.ref.reliable", "Reliable", 16, nil, 0x1000),
	msg_ref_reserved = ProtoField.bool("knetgo.msg.ref.reserved", "Reserved bit", 16, nil, 0x0800),
	msg_length = ProtoField.uint16("knetgo.msg.length", "ContentLength", base.DEC, nil, 0x07FF),
	msg_single = ProtoField.uint8("knetgo.msg.single_index", "SingleInOrderIndex"),
	msg_multi_count = ProtoField.uint8("knetgo.msg.multi_count", "MultiInOrderIndexCount"),
	msg_multi_index = ProtoField.uint8("knetgo.msg.multi_index", "MultiInOrderIndex"),
	msg_latest = ProtoField.bool("knetgo.msg.latest_state", "Latest state (knet: replaces the messages it names)"),
	msg_dep = ProtoField.string("knetgo.msg.depends_on", "Depends on"),
	msg_rel_delta = ProtoField.uint16("knetgo.msg.rel_delta", "Reliable number delta"),
	msg_relnum = ProtoField.uint32("knetgo.msg.relnum", "Reliable message number"),
	msg_frag_count = ProtoField.uint32("knetgo.msg.frag_count", "FragmentCount"),
	msg_transfer = ProtoField.uint8("knetgo.msg.transfer_id", "TransferID"),
	msg_frag_number = ProtoField.uint32("knetgo.msg.frag_number", "FragmentNumber"),
	msg_id = ProtoField.uint32("knetgo.msg.id", "MessageID", base.DEC, msg_names),
	msg_name = ProtoField.string("knetgo.msg.name", "Message name"),
	msg_payload_len = ProtoField.uint32("knetgo.msg.payload_len", "Payload length"),
	msg_payload = ProtoField.bytes("knetgo.msg.payload", "Payload"),
	-- Reserved message contents.
	ping_id = ProtoField.uint8("knetgo.ping.id", "pingID"),
	flow_rate = ProtoField.uint16("knetgo.flow.rate", "newDatagramReceiveRate"),
	ack_base = ProtoField.uint32("knetgo.ack.base", "Base PacketID"),
	ack_bits24 = ProtoField.uint8("knetgo.ack.bits_low", "Bits 22-23 (ack base+1, base+2)", base.HEX),
	ack_bits = ProtoField.uint32("knetgo.ack.bits", "Sequence bits", base.HEX),
	ack_id = ProtoField.uint32("knetgo.ack.id", "Acked PacketID"),
	connect_data = ProtoField.bytes("knetgo.connect.data", "Application content"),
	-- knet's extensions in reserved ID 5 (docs/PROTOCOL.md 4).
	ext_kind = ProtoField.uint8("knetgo.ext.kind", "knet extension", base.DEC,
		{ [1] = "AckRequest", [2] = "LatestStateTag", [3] = "DrainNotice", [4] = "CloseCode" }),
	close_code = ProtoField.uint32("knetgo.close.code", "Close code (CloseWithError)"),
	latest_content = ProtoField.uint32("knetgo.latest.content_id", "ContentID"),
	latest_version = ProtoField.uint32("knetgo.latest.version", "Version number"),
}
knet.fields = pf

local ef = {
	malformed = ProtoExpert.new("knetgo.malformed", "Malformed kNet datagram",
		expert.group.MALFORMED, expert.severity.ERROR),
	note = ProtoExpert.new("knetgo.note", "kNet note", expert.group.PROTOCOL, expert.severity.NOTE),
}
knet.experts = ef

knet.prefs.dialect = Pref.enum("Dialect", 1,
	"Which wire to decode: auto (per conversation, see the script), spec or reference",
	{ { 1, "auto", 1 }, { 2, "spec", 2 }, { 3, "reference", 3 } }, false)
knet.prefs.ports = Pref.range("UDP ports", "7000", "UDP ports decoded as kNet", 65535)

-- Arithmetic without bit operators: Lua 5.2 and 5.4 builds alike.
local function bits(v, shift, width)
	return math.floor(v / 2 ^ shift) % 2 ^ width
end

-- Parsing. Each parser reads tvb into a plain table with the offsets of
-- its fields and stops at the first error, recording it (err, err_at);
-- rendering is separate, so that auto mode can try both dialects.

local function u8(tvb, o) return tvb(o, 1):uint() end
local function le(tvb, o, n) return tvb(o, n):le_uint() end

-- VLE-1.7/8: 1 or 2 bytes. Returns value, size or nil when short.
local function vle16(tvb, o, n)
	if o >= n then return nil end
	local b0 = u8(tvb, o)
	if b0 < 0x80 then return b0, 1 end
	if o + 2 > n then return nil end
	return b0 % 0x80 + u8(tvb, o + 1) * 0x80, 2
end

-- VLE-1.7/1.7/16: 1, 2 or 4 bytes.
local function vle32(tvb, o, n)
	if o >= n then return nil end
	local b0 = u8(tvb, o)
	if b0 < 0x80 then return b0, 1 end
	if o + 2 > n then return nil end
	local b1 = u8(tvb, o + 1)
	if b1 < 0x80 then return b0 % 0x80 + b1 * 0x80, 2 end
	if o + 4 > n then return nil end
	return b0 % 0x80 + (b1 % 0x80) * 0x80 + le(tvb, o + 2, 2) * 0x4000, 4
end

-- VLE-1.15/16 (reference ReliableMsgNumBase): 2 or 4 bytes.
local function vle1516(tvb, o, n)
	if o + 2 > n then return nil end
	local lo = le(tvb, o, 2)
	if lo < 0x8000 then return lo, 2 end
	if o + 4 > n then return nil end
	return lo % 0x8000 + le(tvb, o + 2, 2) * 0x8000, 4
end

local function fail(d, at, text)
	d.err, d.err_at = text, at
	return d
end

-- The content block: [MessageID] payload, shared by both dialects.
local function parse_content(tvb, m, o, n, cl)
	if n - o < cl then
		return "ContentLength " .. cl .. " runs past the datagram"
	end
	m.content_at, m.cl = o, cl
	local p = o
	if m.fragstart or not m.fragment then
		local id, k = vle32(tvb, p, o + cl)
		if not id then return "content block too short for its MessageID" end
		m.id, m.id_at, m.id_len = id, p, k
		p = p + k
	end
	m.payload_at, m.payload_len = p, o + cl - p
	m.size = o + cl - m.at
	return nil
end

-- The end of a message block in both dialects: the fragment fields, then
-- the content block. Returns an error and where it was found, or nil.
local function parse_tail(tvb, m, p, n, cl)
	if m.fragstart then
		local x, k = vle32(tvb, p, n)
		if not x then return "message block truncated", p end
		m.frag_count, m.frag_count_at, m.frag_count_len = x, p, k
		p = p + k
	end
	if m.fragment then
		if p >= n then return "message block truncated", p end
		m.transfer, m.transfer_at = u8(tvb, p), p
		p = p + 1
	end
	if m.fragment and not m.fragstart then
		local x, k = vle32(tvb, p, n)
		if not x then return "message block truncated", p end
		m.frag_number, m.frag_number_at, m.frag_number_len = x, p, k
		p = p + k
	end
	return parse_content(tvb, m, p, n, cl), p
end

local function parse_spec(tvb)
	local n = tvb:len()
	local d = { dialect = "spec", msgs = {}, deltas = {}, indices = {} }
	if n < 3 then return fail(d, 0, "datagram shorter than its 3-byte header") end
	local v = le(tvb, 0, 3)
	d.pid = v % PID_MOD
	d.reliable = bits(v, 22, 1) == 1
	d.inorder = bits(v, 23, 1) == 1
	local o = 3
	if d.inorder then
		if o >= n then return fail(d, o, "truncated before InOrderDeltaCount") end
		d.count = u8(tvb, o)
		o = o + 1
		for _, arr in ipairs({ d.deltas, d.indices }) do
			for _ = 1, d.count do
				local x, k = vle16(tvb, o, n)
				if not x then return fail(d, o, "truncated in the InOrder arrays") end
				arr[#arr + 1] = { v = x, at = o, len = k }
				o = o + k
			end
		end
	end
	d.body_at = o
	while o < n do
		local m = { at = o, index = #d.msgs }
		d.msgs[#d.msgs + 1] = m
		if n - o < 2 then return fail(d, o, "message block truncated") end
		local h = le(tvb, o, 2)
		m.fragstart = bits(h, 15, 1) == 1
		-- A FragmentStart is a fragment whether or not bit 14 is set.
		m.fragment = bits(h, 14, 1) == 1 or m.fragstart
		m.order = bits(h, 11, 3)
		local cl = h % 0x800
		local p = o + 2
		if m.order == 6 then
			if p >= n then return fail(d, p, "message block truncated") end
			m.single, m.single_at = u8(tvb, p), p
			p = p + 1
		elseif m.order == 7 then
			if p >= n then return fail(d, p, "message block truncated") end
			local k = u8(tvb, p)
			m.multi_at = p
			if p + 1 + k > n then return fail(d, p, "message block truncated") end
			m.multi = {}
			for i = 1, k do m.multi[i] = u8(tvb, p + i) end
			p = p + 1 + k
		end
		local e, at = parse_tail(tvb, m, p, n, cl)
		if e then return fail(d, at, e) end
		-- What scanDatagram refuses besides the encoding.
		if m.order ~= 0 then
			if not d.inorder then
				return fail(d, o, "InOrder code in a datagram without the InOrder flag")
			end
			local named = m.multi or { m.single or (m.order - 1) }
			for _, x in ipairs(named) do
				if x >= d.count then
					return fail(d, o, "InOrder code names entry " .. x .. " beyond InOrderDeltaCount " .. d.count)
				end
			end
		end
		if m.fragment and not d.reliable then
			return fail(d, o, "fragment in an unreliable datagram")
		end
		o = o + m.size
	end
	return d
end

local function parse_ref(tvb)
	local n = tvb:len()
	local d = { dialect = "reference", msgs = {} }
	if n < 3 then return fail(d, 0, "datagram shorter than its 3-byte header") end
	local b0 = u8(tvb, 0)
	d.pid = b0 % 64 + le(tvb, 1, 2) * 64
	d.inorder = b0 >= 0x80
	d.reliable = bits(b0, 6, 1) == 1
	local o = 3
	if d.reliable then
		local x, k = vle1516(tvb, o, n)
		if not x then return fail(d, o, "truncated in ReliableMsgNumBase") end
		d.relbase, d.relbase_at, d.relbase_len = x, o, k
		o = o + k
	end
	d.body_at = o
	while o < n do
		local m = { at = o, index = #d.msgs }
		d.msgs[#d.msgs + 1] = m
		if n - o < 2 then return fail(d, o, "message block truncated") end
		local h = le(tvb, o, 2)
		if bits(h, 11, 1) == 1 then return fail(d, o, "message header has its reserved bit 11 set") end
		m.fragstart = bits(h, 15, 1) == 1
		m.fragment = bits(h, 14, 1) == 1 or m.fragstart
		m.inorder = bits(h, 13, 1) == 1
		m.reliable = bits(h, 12, 1) == 1
		local cl = h % 0x800
		local p = o + 2
		if m.reliable then
			if not d.reliable then
				return fail(d, o, "reliable message in a datagram without ReliableMsgNumBase")
			end
			local x, k = vle16(tvb, p, n)
			if not x then return fail(d, p, "message block truncated") end
			if d.relbase + x > MAX_REL_NUM then return fail(d, p, "reliable number out of range") end
			m.rel_delta, m.rel_delta_at, m.rel_delta_len = x, p, k
			m.relnum = d.relbase + x
			p = p + k
		end
		local e, at = parse_tail(tvb, m, p, n, cl)
		if e then return fail(d, at, e) end
		o = o + m.size
	end
	return d
end

local function is_opening(tvb)
	if tvb:len() ~= 8 then return false end
	return tvb(0, 4):uint() == 0 and tvb(4, 4):uint() == 0
end

local function has_handshake(d)
	for _, m in ipairs(d.msgs) do
		if m.id and not (m.fragment and not m.fragstart) and
			(m.id == ID_CONNECT_SYN or m.id == ID_CONNECT_SYN_ACK or m.id == ID_CONNECT_ACK) then
			return true
		end
	end
	return false
end

-- The reference sets the datagram's Reliable and InOrder bits exactly when
-- one of its messages has them (README facts 7 and 8), and so does knet
-- in that dialect: a cheap check that a datagram really is reference.
local function ref_consistent(d)
	local r, io = false, false
	for _, m in ipairs(d.msgs) do
		r = r or m.reliable
		io = io or m.inorder
	end
	return #d.msgs > 0 and r == d.reliable and io == d.inorder
end

-- Dialect state per conversation, reset with each capture.
local convs = {}  -- conversation key -> { dialect, since = frame number }
local frames = {} -- frame number -> dialect chosen, stable across passes

local function conv_key(pinfo)
	local a = tostring(pinfo.src) .. ":" .. tostring(pinfo.src_port)
	local b = tostring(pinfo.dst) .. ":" .. tostring(pinfo.dst_port)
	if a > b then a, b = b, a end
	return a .. "|" .. b
end

function knet.init()
	convs, frames = {}, {}
end

-- choose returns the parse of tvb to show, or "opening", and why.
local function choose(tvb, pinfo)
	local pref = dialect_names[knet.prefs.dialect] or "auto"
	if pref == "spec" then return parse_spec(tvb), "preference" end
	if pref == "reference" then
		if is_opening(tvb) then return "opening", "preference" end
		return parse_ref(tvb), "preference"
	end
	local num = pinfo.number
	local known = frames[num]
	if known == "opening" then return "opening", "conversation" end
	if known == "spec" then return parse_spec(tvb), "conversation" end
	if known == "reference" then return parse_ref(tvb), "conversation" end
	local key = conv_key(pinfo)
	local c = convs[key]
	local result, why
	if is_opening(tvb) then
		-- A new reference connection, possibly after a spec one.
		convs[key] = { dialect = "reference", since = num }
		result, why = "opening", "reference opening"
	elseif c and num >= c.since then
		if c.dialect == "spec" then
			result = parse_spec(tvb)
		else
			result = parse_ref(tvb)
		end
		why = "conversation"
	else
		local s, r = parse_spec(tvb), parse_ref(tvb)
		if not s.err and has_handshake(s) then
			convs[key] = { dialect = "spec", since = num }
			result, why = s, "spec handshake"
		elseif s.err and not r.err then
			result, why = r, "heuristic"
		elseif r.err and not s.err then
			result, why = s, "heuristic"
		elseif not r.err and ref_consistent(r) then
			result, why = r, "heuristic"
		else
			result, why = s, "heuristic"
		end
	end
	frames[num] = type(result) == "table" and result.dialect or result
	return result, why
end

-- Rendering.

local function add_ack(t, tvb, m, dialect)
	local at, len = m.payload_at, m.payload_len
	if len ~= 7 then
		t:add_proto_expert_info(ef.malformed, "PacketAck content must be 7 bytes, is " .. len)
		return "PacketAck (bad length)", true
	end
	local v = le(tvb, at, 3)
	local base = v % PID_MOD
	local w = le(tvb, at + 3, 4)
	t:add(pf.ack_base, tvb(at, 3), base)
	local ids = { base }
	if dialect == "spec" then
		-- Bits 22-23 of the u24 ack base+1, base+2; u32 bit i acks base+3+i.
		local low = bits(v, 22, 2)
		t:add(pf.ack_bits24, tvb(at + 2, 1), low)
		for i = 0, 1 do
			if bits(low, i, 1) == 1 then ids[#ids + 1] = (base + 1 + i) % PID_MOD end
		end
		t:add_le(pf.ack_bits, tvb(at + 3, 4))
		for i = 0, 31 do
			if bits(w, i, 1) == 1 then ids[#ids + 1] = (base + 3 + i) % PID_MOD end
		end
	else
		-- Reference: u32 bit i acks base+1+i.
		t:add_le(pf.ack_bits, tvb(at + 3, 4))
		for i = 0, 31 do
			if bits(w, i, 1) == 1 then ids[#ids + 1] = (base + 1 + i) % PID_MOD end
		end
	end
	for _, id in ipairs(ids) do
		t:add(pf.ack_id, tvb(at, 7), id):set_generated()
	end
	return "PacketAck " .. base .. (#ids > 1 and ("+" .. (#ids - 1)) or ""), false
end

-- add_reserved decodes the content of a reserved message and returns its
-- summary for the Info column.
local function add_reserved(t, tvb, m, dialect)
	local id, at, len = m.id, m.payload_at, m.payload_len
	local name = msg_names[id]
	if id == ID_PACKET_ACK then
		return add_ack(t, tvb, m, dialect)
	elseif id == ID_PING_REQUEST or id == ID_PING_REPLY then
		if len >= 1 then
			t:add(pf.ping_id, tvb(at, 1))
			return name .. " " .. u8(tvb, at)
		end
		t:add_proto_expert_info(ef.note, name .. " without its pingID")
	elseif id == ID_FLOW_CONTROL then
		if len >= 2 then
			t:add_le(pf.flow_rate, tvb(at, 2))
			return name .. " " .. le(tvb, at, 2) .. "/s"
		end
		t:add_proto_expert_info(ef.note, name .. " without its u16 rate")
	elseif id == ID_ANCHOR and dialect == "spec" and len == 1 and u8(tvb, at) == 1 then
		-- An unreliable datagram asking to be acked (delivery receipts).
		t:add(pf.ext_kind, tvb(at, 1))
		return "AckRequest"
	elseif id == ID_ANCHOR and dialect == "spec" and len == 1 and u8(tvb, at) == 3 then
		-- With a Disconnect: the closer reads on (a drain); the peer
		-- delivers what it has in flight before its DisconnectAck.
		t:add(pf.ext_kind, tvb(at, 1))
		return "DrainNotice"
	elseif id == ID_ANCHOR and dialect == "spec" and len == 5 and u8(tvb, at) == 4 then
		-- With a Disconnect: the closer's code (CloseWithError).
		t:add(pf.ext_kind, tvb(at, 1))
		t:add_le(pf.close_code, tvb(at + 1, 4))
		return "CloseCode " .. le(tvb, at + 1, 4)
	elseif id == ID_ANCHOR and dialect == "spec" and len == 9 and u8(tvb, at) == 2 then
		-- The next message is a reliable latest-state version.
		t:add(pf.ext_kind, tvb(at, 1))
		t:add_le(pf.latest_content, tvb(at + 1, 4))
		t:add_le(pf.latest_version, tvb(at + 5, 4))
		return "LatestStateTag " .. le(tvb, at + 1, 4) .. " v" .. le(tvb, at + 5, 4)
	elseif id == ID_CONNECT_SYN or id == ID_CONNECT_SYN_ACK then
		if len > 0 then t:add(pf.connect_data, tvb(at, len)) end
	elseif len > 0 and (id == ID_DISCONNECT or id == ID_DISCONNECT_ACK or id == ID_CONNECT_ACK) then
		t:add_proto_expert_info(ef.note, name .. " carries no data, has " .. len .. " bytes")
	end
	return name
end

local function render_msg(tree, tvb, d, m)
	local size = m.size or (tvb:len() - m.at)
	local t = tree:add(pf.msg, tvb(m.at, size))
	t:add(pf.msg_index, m.index):set_generated()
	if tvb:len() - m.at < 2 then return t, nil end
	local ht = t:add_le(pf.msg_header, tvb(m.at, 2))
	ht:add_le(pf.msg_fragstart, tvb(m.at, 2))
	ht:add_le(pf.msg_fragment, tvb(m.at, 2))
	if d.dialect == "spec" then
		ht:add_le(pf.msg_order, tvb(m.at, 2))
	else
		ht:add_le(pf.msg_ref_inorder, tvb(m.at, 2))
		ht:add_le(pf.msg_ref_reliable, tvb(m.at, 2))
		ht:add_le(pf.msg_ref_reserved, tvb(m.at, 2))
	end
	ht:add_le(pf.msg_length, tvb(m.at, 2))
	if m.single_at then
		t:add(pf.msg_single, tvb(m.single_at, 1))
	end
	if m.multi then
		t:add(pf.msg_multi_count, tvb(m.multi_at, 1))
		for i = 1, #m.multi do t:add(pf.msg_multi_index, tvb(m.multi_at + i, 1)) end
		local k = #m.multi
		if k >= 2 and m.multi[1] == m.multi[k] then
			t:add(pf.msg_latest, true):set_generated()
		end
	end
	if d.dialect == "spec" and m.order ~= 0 and m.size then
		local named = m.multi or { m.single or (m.order - 1) }
		for _, x in ipairs(named) do
			local e = d.deltas[x + 1]
			if e then
				local pid = (d.pid - e.v - 1) % PID_MOD
				t:add(pf.msg_dep, "PacketID " .. pid .. " message " .. d.indices[x + 1].v):set_generated()
			end
		end
	end
	if m.rel_delta_at then
		t:add(pf.msg_rel_delta, tvb(m.rel_delta_at, m.rel_delta_len), m.rel_delta)
		t:add(pf.msg_relnum, tvb(m.rel_delta_at, m.rel_delta_len), m.relnum):set_generated()
	end
	if m.frag_count_at then
		t:add(pf.msg_frag_count, tvb(m.frag_count_at, m.frag_count_len), m.frag_count)
	end
	if m.transfer_at then
		t:add(pf.msg_transfer, tvb(m.transfer_at, 1))
	end
	if m.frag_number_at then
		t:add(pf.msg_frag_number, tvb(m.frag_number_at, m.frag_number_len), m.frag_number)
	end
	if not m.size then return t, nil end
	local summary
	if m.id_at then
		t:add(pf.msg_id, tvb(m.id_at, m.id_len), m.id)
	end
	local whole = not m.fragment
	local name = m.id_at and msg_names[m.id]
	if name then
		local it = t:add(pf.msg_name, name)
		it:set_generated()
		if m.id == ID_ANCHOR then
			-- knet pads its ConnectSyn datagram with it, and anchors
			-- in-order messages with an empty one (docs/PROTOCOL.md 4).
			it:append_text(" (ignored by receivers: knet's padding, in-order anchor, ack request, latest-state tag, drain notice or server query)")
		end
	end
	t:add(pf.msg_payload_len, m.payload_len):set_generated()
	if m.payload_len > 0 then t:add(pf.msg_payload, tvb(m.payload_at, m.payload_len)) end
	local label
	if whole and name then
		local bad
		summary, bad = add_reserved(t, tvb, m, d.dialect)
		label = summary
		if bad then d.bad_content = true end
	elseif m.fragstart then
		summary = (name or tostring(m.id)) .. " frag 0/" .. m.frag_count .. " T" .. m.transfer
		label = summary .. ", " .. m.payload_len .. " B"
	elseif m.fragment then
		summary = "frag " .. m.frag_number .. " T" .. m.transfer
		label = summary .. ", " .. m.payload_len .. " B"
	else
		summary = tostring(m.id) .. " (" .. m.payload_len .. " B)"
		label = "ID " .. m.id .. ", " .. m.payload_len .. " B"
	end
	local flags = ""
	if m.reliable then flags = flags .. " R#" .. m.relnum end
	if m.inorder or (m.order and m.order ~= 0) then flags = flags .. " O" end
	t:set_text("Message " .. m.index .. ": " .. label .. flags)
	return t, summary
end

local function render(tvb, pinfo, tree, d, why)
	local root = tree:add(knet, tvb())
	pinfo.cols.protocol = "kNet"
	if d == "opening" then
		root:add(pf.dialect, "reference"):set_generated()
		root:add(pf.opening, tvb())
		root:append_text(" (reference), connection opening")
		pinfo.cols.info = "Reference connection opening"
		return
	end
	local dt = root:add(pf.dialect, d.dialect)
	dt:set_generated()
	dt:append_text(" (" .. why .. ")")
	local n = tvb:len()
	if d.pid then
		root:add(pf.packetid, tvb(0, 3), d.pid):set_generated()
		if d.dialect == "spec" then
			local ht = root:add_le(pf.header, tvb(0, 3))
			ht:add_le(pf.reliable, tvb(0, 3))
			ht:add_le(pf.inorder, tvb(0, 3))
			if d.count then
				root:add(pf.io_count, tvb(3, 1))
				for i, e in ipairs(d.deltas) do
					local it = root:add(pf.io_delta, tvb(e.at, e.len), e.v)
					it:add(pf.io_dep, tvb(e.at, e.len), (d.pid - e.v - 1) % PID_MOD):set_generated()
					it:prepend_text("[" .. (i - 1) .. "] ")
				end
				for i, e in ipairs(d.indices) do
					root:add(pf.io_index, tvb(e.at, e.len), e.v):prepend_text("[" .. (i - 1) .. "] ")
				end
			end
		else
			local ft = root:add(pf.ref_flags, tvb(0, 1))
			ft:add(pf.ref_inorder, tvb(0, 1))
			ft:add(pf.ref_reliable, tvb(0, 1))
			root:add_le(pf.ref_pid_hi, tvb(1, 2))
			if d.relbase_at then
				root:add(pf.ref_relbase, tvb(d.relbase_at, d.relbase_len), d.relbase)
			end
		end
	end
	local parts = {}
	for _, m in ipairs(d.msgs) do
		local _, summary = render_msg(root, tvb, d, m)
		if summary then parts[#parts + 1] = summary end
	end
	local info = d.pid and ("PID " .. d.pid) or "?"
	if d.reliable then info = info .. " R" end
	if d.inorder then info = info .. " O" end
	if d.relbase then info = info .. " base " .. d.relbase end
	info = info .. ": " .. table.concat(parts, ", ")
	root:append_text(", " .. d.dialect .. ", " .. info)
	if d.err then
		local at = math.min(d.err_at or 0, n)
		local range = at < n and tvb(at) or tvb()
		root:add_tvb_expert_info(ef.malformed, range, d.err)
		info = info .. " [malformed: " .. d.err .. "]"
	end
	pinfo.cols.info = info
end

function knet.dissector(tvb, pinfo, tree)
	local d, why = choose(tvb, pinfo)
	render(tvb, pinfo, tree, d, why)
	return tvb:len()
end

-- The heuristic claims only what is kNet beyond doubt: the reference's
-- opening, a spec handshake, and conversations already claimed so.
local function heuristic(tvb, pinfo, tree)
	local key = conv_key(pinfo)
	if not (frames[pinfo.number] or convs[key] or is_opening(tvb)) then
		local s = parse_spec(tvb)
		if s.err or not has_handshake(s) then return false end
	end
	knet.dissector(tvb, pinfo, tree)
	pinfo.conversation = knet
	return true
end

local udp_table = DissectorTable.get("udp.port")
local registered = ""

local function register_ports()
	if registered ~= "" then udp_table:remove(registered, knet) end
	registered = tostring(knet.prefs.ports)
	if registered ~= "" then udp_table:add(registered, knet) end
end

function knet.prefs_changed()
	register_ports()
end

register_ports()
udp_table:add_for_decode_as(knet)
knet:register_heuristic("udp", heuristic)

-- kNet over TCP -----------------------------------------------------------

local knettcp = Proto("knetgo_tcp", "kNet over TCP (knet-go)")

local HELLO_MAGIC = "006b4e5401" -- 00 'k' 'N' 'T' 01

local tf = {
	frame = ProtoField.none("knetgo_tcp.frame", "Frame"),
	size = ProtoField.uint32("knetgo_tcp.size", "Size (MessageID field + payload)"),
	id = ProtoField.uint32("knetgo_tcp.id", "MessageID", base.DEC, msg_names),
	payload_len = ProtoField.uint32("knetgo_tcp.payload_len", "Payload length"),
	payload = ProtoField.bytes("knetgo_tcp.payload", "Payload"),
	ping_id = ProtoField.uint8("knetgo_tcp.ping.id", "pingID"),
	hello = ProtoField.uint8("knetgo_tcp.hello", "knet hello", base.DEC,
		{ [1] = "client hello (ConnectPayload)", [2] = "accept (Admit reply)", [3] = "refuse (reason)", [4] = "close (reason)",
		  [5] = "secure (Noise message 1)", [6] = "secure accept (Noise message 2)", [7] = "close (code u32 LE, reason)" }),
	hello_content = ProtoField.bytes("knetgo_tcp.hello.content", "Hello content"),
}
knettcp.fields = tf

local tef = {
	malformed = ProtoExpert.new("knetgo_tcp.malformed", "Malformed kNet over TCP frame",
		expert.group.MALFORMED, expert.severity.ERROR),
}
knettcp.experts = tef

knettcp.prefs.ports = Pref.range("TCP ports", "7000", "TCP ports decoded as kNet over TCP", 65535)
-- The reference closes a connection on a size field over 10 MiB; a knet
-- peer's limit is its MaxMessageSize plus 4.
knettcp.prefs.max_frame = Pref.uint("Largest frame size", 10 * 1024 * 1024,
	"A larger size field is malformed (the reference's limit: 10485760)")

-- One whole frame at tvb(o, total): its size field is k bytes.
local function tcp_frame(tvb, tree, o, k, size)
	local n = o + k + size
	local t = tree:add(tf.frame, tvb(o, k + size))
	t:add(tf.size, tvb(o, k), size)
	local id, m = vle32(tvb, o + k, n)
	if not id then
		t:add_tvb_expert_info(tef.malformed, tvb(o, k + size), "the MessageID runs past the frame's size")
		return "malformed"
	end
	t:add(tf.id, tvb(o + k, m), id)
	local po, plen = o + k + m, size - m
	t:add(tf.payload_len, plen)
	if plen > 0 then t:add(tf.payload, tvb(po, plen)) end
	local name = msg_names[id] or tostring(id)
	if (id == ID_PING_REQUEST or id == ID_PING_REPLY) and plen >= 1 then
		t:add(tf.ping_id, tvb(po, 1))
		if id == ID_PING_REPLY and plen >= 6 and tvb(po, 5):bytes():tohex():lower() == HELLO_MAGIC then
			local kind = u8(tvb, po + 5)
			t:add(tf.hello, tvb(po + 5, 1))
			if plen > 6 then t:add(tf.hello_content, tvb(po + 6, plen - 6)) end
			name = "knet hello " .. kind
		end
	end
	t:set_text(string.format("Frame: %s, %d bytes", name, k + size))
	return name
end

function knettcp.dissector(tvb, pinfo, tree)
	local n = tvb:len()
	local o = 0
	local root
	local names = {}
	while o < n do
		local size, k = vle32(tvb, o, n)
		if not size then
			-- The size field goes on in the next segment.
			pinfo.desegment_offset = o
			pinfo.desegment_len = DESEGMENT_ONE_MORE_SEGMENT
			break
		end
		root = root or tree:add(knettcp, tvb(o))
		if size == 0 or size > knettcp.prefs.max_frame then
			-- The stream cannot be cut into frames any further.
			root:add_tvb_expert_info(tef.malformed, tvb(o, k), "frame size " .. size .. (size == 0 and "" or " over the limit"))
			names[#names + 1] = "malformed"
			o = n
			break
		end
		if o + k + size > n then
			pinfo.desegment_offset = o
			pinfo.desegment_len = o + k + size - n
			break
		end
		names[#names + 1] = tcp_frame(tvb, root, o, k, size)
		o = o + k + size
	end
	if #names > 0 then
		pinfo.cols.protocol = "kNet/TCP"
		local info = table.concat(names, ", ", 1, math.min(#names, 8))
		if #names > 8 then info = info .. string.format(", ... (%d frames)", #names) end
		pinfo.cols.info = info
		root:append_text(string.format(", %d frame%s", #names, #names == 1 and "" or "s"))
	end
	return n
end

local tcp_seq = Field.new("tcp.seq")

-- The heuristic claims a stream by its first bytes: the reference's first
-- frame (its PingRequest, perhaps after the reply to the peer's), or
-- knet's hello.
local function tcp_heuristic(tvb, pinfo, tree)
	local seq = tcp_seq()
	if not seq or seq.value ~= 1 or tvb:len() < 3 then return false end
	local head = tvb(0, math.min(tvb:len(), 8)):bytes():tohex():lower()
	local ok = head:sub(1, 4) == "0201" or head:sub(1, 4) == "0202" and head:sub(7, 10) == "0201"
	if not ok and tvb:len() >= 7 then
		local size, k = vle32(tvb, 0, tvb:len())
		ok = size and k and tvb:len() >= k + 6 and u8(tvb, k) == ID_PING_REPLY and
			tvb(k + 1, 5):bytes():tohex():lower() == HELLO_MAGIC
	end
	if not ok then return false end
	pinfo.conversation = knettcp
	knettcp.dissector(tvb, pinfo, tree)
	return true
end

local tcp_table = DissectorTable.get("tcp.port")
local tcp_registered = ""

local function register_tcp_ports()
	if tcp_registered ~= "" then tcp_table:remove(tcp_registered, knettcp) end
	tcp_registered = tostring(knettcp.prefs.ports)
	if tcp_registered ~= "" then tcp_table:add(tcp_registered, knettcp) end
end

function knettcp.prefs_changed()
	register_tcp_ports()
end

register_tcp_ports()
tcp_table:add_for_decode_as(knettcp)
knettcp:register_heuristic("tcp", tcp_heuristic)
