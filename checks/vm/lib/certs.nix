# A throwaway CA and a server certificate for the upstream node. Built at
# test build time; the key never leaves the test.
{ pkgs }:
pkgs.runCommand "nixcage-test-certs" { nativeBuildInputs = [ pkgs.openssl ]; } ''
  mkdir $out
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=nixcage test CA" -keyout $out/ca.key -out $out/ca.crt
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=api.example.com" -keyout $out/server.key -out server.csr
  printf 'subjectAltName=DNS:api.example.com,DNS:evil.example.org\n' > ext
  openssl x509 -req -in server.csr -CA $out/ca.crt -CAkey $out/ca.key -CAcreateserial \
    -days 3650 -extfile ext -out $out/server.crt
''
