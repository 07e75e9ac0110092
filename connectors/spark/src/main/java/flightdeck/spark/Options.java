package flightdeck.spark;

import java.io.Serializable;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Map;

/**
 * The connector's options: {@code uri} (default {@code local}: the server on
 * each executor's own node; reads given only {@code uris} go through the
 * first), {@code uris} (comma-separated: partition
 * {@code p} goes to the ({@code p} mod n)-th), {@code dataset} (required),
 * {@code batch_rows} (rows per record batch sent or read; default: Spark's
 * {@code spark.sql.execution.arrow.maxRecordsPerBatch} for writes, the
 * server's {@code --default-batch-rows} for reads), {@code token}
 * (default: {@code FLIGHTDECK_TOKEN}) and, for reads, {@code filter}: a SQL
 * boolean expression over the dataset's columns that the server evaluates
 * so that only the rows it selects are sent (the read plan's filter;
 * Spark's own filters on simple columns are pushed down the same way).
 * Any other option is refused, naming the one meant where the spelling is
 * close.
 */
record Options(
    String uri, List<String> uris, String dataset, int batchRows, String token, String filter)
    implements Serializable {

  /** Every option a read takes; a write takes all but {@code filter}. */
  static final List<String> NAMES = List.of("uri", "uris", "dataset", "batch_rows", "token", "filter");

  /**
   * What Spark adds to the options of a table made with {@code CREATE TABLE
   * ... USING flightdeck OPTIONS (...)} (its catalog's reserved properties and
   * the table's path; {@code option.*} repeats the options): not the user's,
   * so not refused, and not used.
   */
  static final List<String> SPARK_TABLE_PROPERTIES = List.of("provider", "location", "comment",
      "owner", "external", "is_managed_location", "collation", "table_type", "path", "paths");

  /** Why a stream ({@code writeStream}, {@code readStream}) is refused, and what to do. */
  static final String NO_STREAMS = "format('flightdeck') writes and reads batches, not streams: "
      + "a dataset is sealed whole and then read, so write each micro-batch of a stream as a "
      + "dataset of its own with foreachBatch "
      + "(df.write.format(\"flightdeck\").option(\"dataset\", \"clicks-\" + batchId)...)";

  /**
   * Reads Spark's options (keys in any case); refuses any other, naming the
   * one meant where the spelling is close: a misspelt {@code filter} would
   * otherwise read every row, a misspelt {@code uris} send every partition
   * to this node's server.
   */
  static Options of(Map<String, String> options) {
    for (String key : options.keySet()) {
      String name = key.toLowerCase(Locale.ROOT);
      if (NAMES.contains(name) || SPARK_TABLE_PROPERTIES.contains(name)
          || name.startsWith("option.")) {
        continue;
      }
      if (name.equals("checkpointlocation")) {
        // A stream's option, which the stream's own refusal would follow.
        throw new UnsupportedOperationException(NO_STREAMS);
      }
      String close = closest(name);
      throw new IllegalArgumentException("unknown option '" + key + "'"
          + (close == null ? "" : " (did you mean '" + close + "'?)")
          + "; format('flightdeck') takes uri, uris, dataset, batch_rows, token and, for "
          + "reads, filter");
    }
    String dataset = get(options, "dataset", "");
    if (dataset.isEmpty() && get(options, "provider", null) != null) {
      // A table Spark's catalog is making: saveAsTable and writeTo(...)
      // give it none of the writer's .option(...) (they go to the write
      // alone), so the table would not know its dataset when read later.
      throw new IllegalArgumentException("a flightdeck table needs its dataset among its own "
          + "options, and Spark gives a table that saveAsTable or writeTo(...).create() makes "
          + "none of the writer's .option(...): make it with CREATE TABLE t [(columns)] USING "
          + "flightdeck OPTIONS (dataset 'NAME', uri 'URI') and fill it with INSERT OVERWRITE "
          + "(or INSERT INTO a new dataset), or with writeTo(t).using(\"flightdeck\")"
          + ".tableProperty(\"dataset\", NAME).tableProperty(\"uri\", URI).create()");
    }
    String path = get(options, "path", null);
    if (dataset.isEmpty() && path != null) {
      throw new IllegalArgumentException("format('flightdeck') names its dataset with an option, "
          + "not a path: .option(\"dataset\", \"" + path + "\") instead of save(\"" + path
          + "\") or load(\"" + path + "\")");
    }
    if (dataset.isEmpty()) {
      throw new IllegalArgumentException(
          "set the dataset to write or read: .option(\"dataset\", NAME)");
    }
    List<String> uris = new ArrayList<>();
    String given = get(options, "uris", null);
    for (String u : (given == null ? "" : given).split(",")) {
      if (!u.strip().isEmpty()) {
        uris.add(u.strip());
      }
    }
    if (given != null && uris.isEmpty()) {
      // An empty variable substituted into it: every partition would go
      // to this node's server instead.
      throw new IllegalArgumentException(
          "option uris names no server ('" + given + "'); give the servers comma-separated, "
              + "e.g. 'grpc://node1:50051,grpc://node2:50051', or leave it out to use uri");
    }
    String rows = get(options, "batch_rows", "");
    int batchRows;
    try {
      batchRows = rows.isEmpty() ? 0 : Integer.parseInt(rows.strip());
    } catch (NumberFormatException e) {
      batchRows = -1;
    }
    if (batchRows < 0 || (batchRows == 0 && !rows.isEmpty())) {
      throw new IllegalArgumentException(
          "option batch_rows must be a whole number of rows, 1 or more, not '" + rows + "'");
    }
    // Reads go through uri, else the first of uris (as the write sent its
    // partitions), else this node's server.
    String uri = get(options, "uri", "").strip();
    if (uri.isEmpty()) {
      uri = uris.isEmpty() ? "local" : uris.get(0);
    }
    return new Options(uri, List.copyOf(uris), dataset, batchRows,
        get(options, "token", ""), get(options, "filter", "").strip());
  }

  /** The option {@code name} is closest to, if a third of its letters or fewer differ. */
  private static String closest(String name) {
    String best = null;
    int bestEdits = Math.max(1, name.length() / 3) + 1;
    for (String known : NAMES) {
      int edits = edits(name, known);
      if (edits < bestEdits) {
        best = known;
        bestEdits = edits;
      }
    }
    return best;
  }

  /** Levenshtein distance: insertions, deletions and substitutions. */
  private static int edits(String a, String b) {
    int[] row = new int[b.length() + 1];
    for (int j = 0; j <= b.length(); j++) {
      row[j] = j;
    }
    for (int i = 1; i <= a.length(); i++) {
      int diagonal = row[0];
      row[0] = i;
      for (int j = 1; j <= b.length(); j++) {
        int above = row[j];
        int substitute = diagonal + (a.charAt(i - 1) == b.charAt(j - 1) ? 0 : 1);
        row[j] = Math.min(substitute, Math.min(above, row[j - 1]) + 1);
        diagonal = above;
      }
    }
    return row[b.length()];
  }

  private static String get(Map<String, String> options, String key, String otherwise) {
    for (Map.Entry<String, String> e : options.entrySet()) {
      if (e.getKey().equalsIgnoreCase(key) && e.getValue() != null) {
        return e.getValue();
      }
    }
    return otherwise;
  }

  /** These options with {@code batch_rows} set where it was not given. */
  Options withDefaultBatchRows(int rows) {
    return batchRows > 0 ? this : new Options(uri, uris, dataset, rows, token, filter);
  }

  /**
   * These options with {@code more} (a SQL condition; may be empty) joined
   * to {@code filter} with AND.
   */
  Options withFilter(String more) {
    if (more.isEmpty()) {
      return this;
    }
    String both = filter.isEmpty() ? more : "(" + filter + ") AND (" + more + ")";
    return new Options(uri, uris, dataset, batchRows, token, both);
  }

  /** Where partition {@code p} is written: {@code uris[p mod n]}, else {@code uri}. */
  String target(int partition) {
    return uris.isEmpty() ? uri : uris.get(Math.floorMod(partition, uris.size()));
  }

  /** Every server the write may touch: each of {@code uris}, else {@code uri}. */
  List<String> targets() {
    return uris.isEmpty() ? List.of(uri) : uris;
  }
}
