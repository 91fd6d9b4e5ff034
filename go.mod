module github.com/knet-go/knet

go 1.26.8

require (
	github.com/coder/websocket v1.8.15
	github.com/flynn/noise v1.1.0
	github.com/stretchr/testify v1.12.1
	golang.org/x/crypto v0.58.0
	golang.org/x/net v0.62.0
	golang.org/x/sys v0.49.0
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect
