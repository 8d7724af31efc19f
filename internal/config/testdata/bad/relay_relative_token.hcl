# want: 14:16 Invalid path
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["alice"]
}
relay {
  token_file = "secrets/telegram"
  owners     = [42]
  account    = "relay"
  chat "alice" {
    chat_id = -100123
  }
}
