// Shows the text a poolipc node sends to the UI (which rung each tensor took) on the node.
import { app } from "../../scripts/app.js";

app.registerExtension({
  name: "poolipc.ShowText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "PoolipcInvertInWorker") return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text ?? []).join("\n");
      let widget = this.widgets?.find((w) => w.name === "poolipc");
      if (!widget) {
        widget = this.addWidget("text", "poolipc", "", () => {}, { serialize: false });
      }
      widget.value = text;
      this.setDirtyCanvas(true, true);
    };
  },
});
